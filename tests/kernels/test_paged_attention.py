"""Paged decode attention (Triton) against a float64 reference, run by Triton's interpreter on the CPU
(and compiled on CUDA where present)."""

import pytest
import torch

triton = pytest.importorskip("triton")


@pytest.fixture
def paged():
    """The kernel module: compiled on CUDA, interpreted on the CPU (tests/conftest.py sets that up)."""
    import engine.kernels.paged_attention_gpu as mod
    return mod, torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _pool_case(lengths, n_kv, g, hs, block, dtype, device, seed):
    """Blocks handed out in a shuffled order, so no sequence is contiguous in the pool."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block) for n in lengths]
    n_blocks = sum(per_seq) + 3  # spare blocks hold garbage the kernel must never read
    order = torch.randperm(n_blocks, generator=gen)
    k_pool = torch.randn(n_blocks * block, n_kv, hs, generator=gen).to(dtype)
    v_pool = torch.randn(n_blocks * block, n_kv, hs, generator=gen).to(dtype)
    width = max(1, max(per_seq))
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(per_seq):
        table[b, :nb] = order[used:used + nb].to(torch.int32)
        used += nb
    q = torch.randn(len(lengths), n_kv * g, hs, generator=gen).to(dtype)
    to = lambda t: t.to(device)
    return to(q), to(k_pool), to(v_pool), to(table), to(torch.tensor(lengths, dtype=torch.int32))


def _reference(q, k_pool, v_pool, table, lengths, block, scale, window=None):
    B, nh, hs = q.shape
    n_kv = k_pool.shape[1]
    o = torch.zeros(B, nh, hs, dtype=torch.float64)
    lse = torch.full((B, nh), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        lo = 0 if window is None else max(0, n - window)
        if n - lo == 0:
            continue
        slots = torch.tensor([int(table[b, j // block]) * block + j % block for j in range(lo, n)])
        k = k_pool.cpu()[slots].double().repeat_interleave(nh // n_kv, dim=1)  # (S, nh, hs)
        v = v_pool.cpu()[slots].double().repeat_interleave(nh // n_kv, dim=1)
        s = torch.einsum("hd,shd->hs", q[b].cpu().double(), k) * scale  # (nh, S)
        lse[b] = torch.logsumexp(s, -1)
        o[b] = torch.einsum("hs,shd->hd", torch.softmax(s, -1), v)
    return o, lse


@pytest.mark.parametrize("lengths,n_kv,g,hs,block,splits", [
    ([1], 1, 1, 16, 16, 1),                # one key
    ([130, 7, 64], 2, 4, 32, 16, 3),       # unequal lengths, not multiples of the block, GQA 4
    ([300], 4, 8, 64, 64, 5),              # GQA 8, several splits over one sequence
    ([0, 45], 2, 2, 16, 8, 2),             # a sequence with no keys yet
    ([200, 65], 1, 6, 32, 16, 4),          # a group that is not a power of two
    ([3, 700], 2, 4, 32, 16, 16),          # more splits than the short sequence has tiles: empty splits
])
def test_paged_decode_matches_reference_fp32(paged, lengths, n_kv, g, hs, block, splits):
    mod, device = paged
    q, k, v, table, lens = _pool_case(lengths, n_kv, g, hs, block, torch.float32, device, seed=len(lengths) * hs)
    scale = hs ** -0.5
    o, lse = mod.paged_decode(q, k, v, table, lens, block, scale, splits)
    ref_o, ref_lse = _reference(q, k, v, table, lens, block, scale)
    assert torch.allclose(o.cpu().double(), ref_o, rtol=1e-5, atol=1e-5)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse.cpu()), empty)
    assert torch.allclose(lse.cpu().double()[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-5)


def test_paged_decode_sliding_window(paged):
    mod, device = paged
    q, k, v, table, lens = _pool_case([100, 33], 2, 2, 16, 16, torch.float32, device, seed=5)
    o, lse = mod.paged_decode(q, k, v, table, lens, 16, 0.25, 3, window=40)
    ref_o, ref_lse = _reference(q, k, v, table, lens, 16, 0.25, window=40)
    assert torch.allclose(o.cpu().double(), ref_o, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter mis-casts fp32 to bf16")
def test_paged_decode_bf16(paged):
    mod, device = paged
    q, k, v, table, lens = _pool_case([257, 90], 4, 8, 64, 64, torch.bfloat16, device, seed=9)
    o, lse = mod.paged_decode(q, k, v, table, lens, 64, 0.125, mod.split_count(257, 2, 4, device))
    ref_o, ref_lse = _reference(q, k, v, table, lens, 64, 0.125)
    assert torch.allclose(o.cpu().double(), ref_o, rtol=2e-2, atol=2e-2)
    assert torch.allclose(lse.cpu().double(), ref_lse, rtol=1e-2, atol=1e-2)


def test_paged_decode_writes_every_output_of_a_reused_scratch(paged):
    """One scratch serves every layer of a step: poisoned with NaN, it must come back fully written
    and give what fresh buffers give, call after call."""
    mod, device = paged
    q, k, v, table, lens = _pool_case([150, 9, 0], 2, 4, 32, 16, torch.float32, device, seed=11)
    splits = 3
    scratch = mod.scratch_for(3, 8, 32, splits, device)
    for t in scratch:
        t.fill_(float("nan"))
    for layer_scale in (0.2, 0.3):  # two "layers" through the same buffers
        o, lse = mod.paged_decode(q, k, v, table, lens, 16, layer_scale, splits, scratch=scratch)
        ref_o, ref_lse = _reference(q, k, v, table, lens, 16, layer_scale)
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        assert torch.allclose(o.cpu().double(), ref_o, rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(ref_lse))


def test_paged_decode_takes_int64_indices(paged):
    """The resident KV hands the kernel int64 views of one step buffer (table, lengths)."""
    mod, device = paged
    q, k, v, table, lens = _pool_case([90, 17], 2, 2, 16, 16, torch.float32, device, seed=13)
    o, lse = mod.paged_decode(q, k, v, table.long(), lens.long(), 16, 0.25, 4)
    ref_o, ref_lse = _reference(q, k, v, table, lens, 16, 0.25)
    assert torch.allclose(o.cpu().double(), ref_o, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_paged_decode_writes_into_out_and_leaves_the_scratch_output_alone(paged):
    """With out, the merge writes the output there (the caller's dtype; here fp32 and fp64, which the
    interpreter casts faithfully) and not into the scratch's own output buffer."""
    mod, device = paged
    q, k, v, table, lens = _pool_case([77, 20], 2, 4, 32, 16, torch.float32, device, seed=17)
    scratch = mod.scratch_for(2, 8, 32, 3, device)
    scratch[2].fill_(float("nan"))
    ref_o, _ = _reference(q, k, v, table, lens, 16, 0.2)
    for dtype in (torch.float32, torch.float64):
        out = torch.full((2, 8, 32), float("nan"), dtype=dtype, device=device)
        o, _ = mod.paged_decode(q, k, v, table, lens, 16, 0.2, 3, scratch=scratch, out=out)
        assert o is out and not torch.isnan(out).any()
        assert torch.allclose(out.cpu().double(), ref_o, rtol=1e-5, atol=1e-5)
    assert torch.isnan(scratch[2]).all()
