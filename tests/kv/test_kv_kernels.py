"""Attention kernels with LSE and the exact LSE merge, against plain full attention in fp32."""

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import attention_cpu
from engine.kernels.attention_cpu import attend_blocks
from engine.kernels.attention_gpu import attend_dense, attend_padded, padding_mask
from engine.kernels import lse_gpu
from engine.kernels.lse import merge_groups, merge_pair, merge_stack

NH, NKV, HS = 8, 2, 16


def full(q, k, v, mask=None):
    """Reference: q (b, nh, T, hs), k, v (b, n_kv, S, hs) → (out, lse) in fp64."""
    g = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def test_merge_of_random_splits_equals_full_attention():
    gen = torch.Generator().manual_seed(1)
    for trial in range(5):
        S = int(torch.randint(3, 300, (1,), generator=gen))
        q = torch.randn(2, NH, 3, HS, generator=gen)
        k, v = torch.randn(2, NKV, S, HS, generator=gen), torch.randn(2, NKV, S, HS, generator=gen)
        ref, ref_lse = full(q, k, v)
        cuts = sorted(torch.randint(1, S, (3,), generator=gen).tolist())
        bounds = [0, *cuts, S]
        parts = [full(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
        parts = [(o.float(), l.float()) for o, l in parts]
        o, lse = parts[0]
        for o2, l2 in parts[1:]:
            o, lse = merge_pair(o, lse, o2, l2)
        assert rel(o, ref) < 1e-5 and rel(lse, ref_lse) < 1e-5
        so, sl = merge_stack(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        assert rel(so, ref) < 1e-5 and rel(sl, ref_lse) < 1e-5


def test_merge_groups_routes_parts_to_rows_and_ignores_empty_parts():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, NH, 1, HS, generator=gen)
    k, v = torch.randn(3, NKV, 40, HS, generator=gen), torch.randn(3, NKV, 40, HS, generator=gen)
    outs, lses, rows = [], [], []
    for b, cuts in enumerate(([0, 10, 40], [0, 40], [0, 5, 6, 40])):
        for a, c in zip(cuts, cuts[1:]):
            o, lse = full(q[b:b + 1], k[b:b + 1, :, a:c], v[b:b + 1, :, a:c])
            outs.append(o.float()), lses.append(lse.float()), rows.append(b)
    outs.append(torch.zeros(1, NH, 1, HS)), lses.append(torch.full((1, NH, 1), float("-inf"))), rows.append(1)
    out, lse = merge_groups(torch.cat(outs), torch.cat(lses), torch.tensor(rows), 3)
    ref, ref_lse = full(q, k, v)
    assert rel(out, ref) < 1e-5 and rel(lse, ref_lse) < 1e-5


@pytest.mark.skipif(lse_gpu.triton is None, reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_kernel_equals_full_attention_per_row(dtype):
    """The one-launch merge (lse_gpu.merge_rows) against full attention: parts in any order and
    dtype, a part without keys, a row without any part (→ 0, LSE −inf), the result cast to `dtype`
    and the merged LSE in fp32."""
    gen = torch.Generator().manual_seed(6)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU Triton's interpreter runs it
    q = torch.randn(3, NH, 2, HS, generator=gen)
    k, v = torch.randn(3, NKV, 50, HS, generator=gen), torch.randn(3, NKV, 50, HS, generator=gen)
    outs, lses, rows = [], [], []
    for b, cuts in ((0, [0, 50]), (2, [0, 13, 14, 50]), (0, [])):
        for a, c in zip(cuts, cuts[1:]):
            o, lse = full(q[b:b + 1], k[b:b + 1, :, a:c], v[b:b + 1, :, a:c])
            outs.append(o.to(dtype)), lses.append(lse.float()), rows.append(b)
    outs.insert(1, torch.zeros(1, NH, 2, HS, dtype=dtype)), lses.insert(1, torch.full((1, NH, 2), float("-inf")))
    rows.insert(1, 2)  # an empty part between row 2's others
    out, lse = lse_gpu.merge_rows(torch.cat(outs).to(dev), torch.cat(lses).to(dev), torch.tensor(rows, device=dev),
                                  3, dtype)
    assert out.dtype == dtype and out.shape == (3, NH, 2, HS)
    assert lse.dtype == torch.float32 and lse.shape == (3, NH, 2)
    ref, ref_lse = full(q, k, v)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel(out[0].cpu(), ref[0]) < tol and rel(out[2].cpu(), ref[2]) < tol
    assert rel(lse[0].cpu(), ref_lse[0]) < 1e-5 and rel(lse[2].cpu(), ref_lse[2]) < 1e-5  # the LSEs are fp32 inputs
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))  # no part: 0, not NaN
    if dev == "cuda":  # a long prefill: (head, query) pairs past the grid's y limit of 65535
        outs, lses = torch.randn(2, 4, 20000, HS, device=dev), torch.randn(2, 4, 20000, device=dev)
        ref, ref_lse = merge_stack(outs, lses)
        out, lse = lse_gpu.merge_rows(outs, lses, torch.zeros(2, dtype=torch.int64, device=dev), 1, torch.float32)
        assert rel(out[0].cpu(), ref.cpu().double()) < 1e-5 and rel(lse[0].cpu(), ref_lse.cpu().double()) < 1e-5


def test_attend_blocks_writes_into_given_buffers():
    """The CPU side writes its result straight into the page-locked buffer it leaves from."""
    gen = torch.Generator().manual_seed(7)
    arena_k, arena_v = torch.randn(NKV, 100, HS, generator=gen), torch.randn(NKV, 100, HS, generator=gen)
    q = torch.randn(2, NH, 1, HS, generator=gen)
    blocks = [[(arena_k[:, 0:60], arena_v[:, 0:60])], [(arena_k[:, 60:100], arena_v[:, 60:100])]]
    ref_out, ref_lse = attend_blocks(q, blocks, HS ** -0.5)
    for impl in (None, "matmul"):
        flat = torch.full((2 * NH * HS + 2 * NH,), float("nan"))
        out, lse = flat[:2 * NH * HS].view(2, NH, 1, HS), flat[2 * NH * HS:].view(2, NH, 1)
        attention_cpu.set_implementation(impl)
        try:
            got_out, got_lse = attend_blocks(q, blocks, HS ** -0.5, out=out, lse=lse)
        finally:
            attention_cpu.set_implementation(None)
        assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
        assert rel(out, ref_out.double()) < 1e-5 and rel(lse, ref_lse.double()) < 1e-5
    prepared = attention_cpu.prepare(blocks)  # the block table, built once for views used again
    got_out, got_lse = attend_blocks(q, prepared, HS ** -0.5)
    assert rel(got_out, ref_out.double()) < 1e-6 and rel(got_lse, ref_lse.double()) < 1e-6
    attend_blocks(q, [[], []], HS ** -0.5, out=out, lse=lse)  # no keys at all: 0 and −inf, written
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


@pytest.mark.parametrize("impl", ["sdpa", "matmul", "native"])
@pytest.mark.parametrize("T", [1, 5])
def test_attend_blocks_reads_strided_views_in_place(impl, T):
    gen = torch.Generator().manual_seed(3)
    arena_k = torch.randn(NKV, 1000, HS, generator=gen)  # per-head rows, like the unpinned region
    arena_v = torch.randn(NKV, 1000, HS, generator=gen)
    runs = [[(0, 37), (100, 164), (500, 501)], [], [(200, 333)]]  # the middle sequence has no CPU share
    q = torch.randn(3, NH, T, HS, generator=gen)
    blocks = [[(arena_k[:, a:b], arena_v[:, a:b]) for a, b in r] for r in runs]
    if impl == "native" and "native" not in attention_cpu._registered:
        pytest.skip("the native extension is not built")
    attention_cpu.set_implementation(impl)
    try:
        out, lse = attend_blocks(q, blocks, HS ** -0.5)
    finally:
        attention_cpu.set_implementation(None)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == (3, NH, T)
    for b, r in enumerate(runs):
        if not r:
            assert torch.all(out[b] == 0) and torch.all(lse[b] == float("-inf"))
            continue
        k = torch.cat([arena_k[:, a:c] for a, c in r], dim=1)[None]
        v = torch.cat([arena_v[:, a:c] for a, c in r], dim=1)[None]
        ref, ref_lse = full(q[b:b + 1], k, v)
        assert rel(out[b:b + 1], ref) < 1e-5 and rel(lse[b:b + 1], ref_lse) < 1e-5


def test_the_probe_picks_an_implementation_and_names_it():
    name = attention_cpu.implementation(torch.float32, NH, NKV, HS)
    assert name in ("sdpa", "matmul", "native")  # native when the C++ extension is built
    assert attention_cpu.kernel_name(torch.float32, NH, NKV, HS).startswith("native" if name == "native" else "torch-")
    assert attention_cpu._probe(torch.float32, NH, NKV, HS) in ("sdpa", "matmul")


def test_padded_and_causal_attention_with_lse():
    gen = torch.Generator().manual_seed(4)
    window = torch.randn(3, 12, 2, NKV, HS, generator=gen)  # (B, D, 2, n_kv, hs): the D-window layout
    k, v = window[:, :, 0].transpose(1, 2), window[:, :, 1].transpose(1, 2)
    lengths = torch.tensor([12, 1, 7])
    q = torch.randn(3, NH, 1, HS, generator=gen)
    out, lse = attend_padded(q, k, v, padding_mask(lengths, 12), HS ** -0.5)
    for b, n in enumerate(lengths.tolist()):
        ref, ref_lse = full(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        assert rel(out[b:b + 1], ref) < 1e-5 and rel(lse[b:b + 1], ref_lse) < 1e-5
    qc, kc, vc = torch.randn(1, NH, 9, HS), torch.randn(1, NKV, 9, HS), torch.randn(1, NKV, 9, HS)
    out, lse = attend_dense(qc, kc, vc, HS ** -0.5, causal=True)
    ref, ref_lse = full(qc, kc, vc, torch.ones(9, 9, dtype=torch.bool).tril())
    assert rel(out, ref) < 1e-5 and rel(lse, ref_lse) < 1e-5
    assert rel(out, F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True).double()) < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flash_parts_merge_to_full_attention_in_bf16():
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, 32, 1, 128, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(3000, 2, 4, 128, device="cuda", generator=gen).bfloat16()  # token-interleaved chunk layout
    k, v = kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]
    o1, l1 = attend_dense(q, k[:, :, :1234], v[:, :, :1234], 128 ** -0.5)
    o2, l2 = attend_dense(q, k[:, :, 1234:], v[:, :, 1234:], 128 ** -0.5)
    out, _ = merge_pair(o1, l1, o2, l2)
    ref, _ = full(q.float().cpu(), k.float().cpu(), v.float().cpu())
    assert rel(out.cpu(), ref) < 1e-2
