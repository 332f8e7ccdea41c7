"""Decode attention over KV blocks (engine/kernels/attention_native.py) against a float64 reference,
for every native ISA of this CPU and the torch fallback. Inputs are fresh random tensors each run."""

import math

import pytest
import torch

from engine.errors import KernelInputError
from engine.kernels import attention_native
from engine.kernels.attention_native import KVBlockTable, attend_blocks

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(q4, k_blocks, v_blocks, scale):
    """float64 attention with LSE: q4 (B, nh, T, hs), blocks per sequence (n_kv, t, hs)."""
    B, nh, T, hs = q4.shape
    out = torch.zeros(B, nh, T, hs, dtype=torch.float64)
    lse = torch.full((B, nh, T), -math.inf, dtype=torch.float64)
    for b in range(B):
        ks = [k for k in k_blocks[b] if k.shape[1]]
        if not ks:
            continue
        keys = torch.cat([k.double() for k in ks], 1)
        values = torch.cat([v.double() for v in v_blocks[b] if v.shape[1]], 1)
        group = nh // keys.shape[0]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # (nh, L, hs)
        scores = torch.einsum("htd,hld->htl", q4[b].double(), keys) * scale
        lse[b] = torch.logsumexp(scores, -1)
        out[b] = torch.softmax(scores, -1) @ values
    return out, lse


def make_blocks(lengths, n_kv, hs, block_size, dtype, layout):
    """Per sequence, blocks of block_size tokens (the last one shorter) as (n_kv, t, hs) views.
    layout 'head-major': views of one (n_kv, L, hs) tensor per sequence;
    'token-major': each block stored (t, n_kv, hs) and permuted (strides (hs, n_kv·hs, 1));
    'padded': views into a wider buffer (head_dim rows of a longer row, so rows are not adjacent)."""
    ks, vs = [], []
    for L in lengths:
        kb, vb = [], []
        if layout == "head-major":
            K, V = torch.randn(n_kv, L, hs).to(dtype), torch.randn(n_kv, L, hs).to(dtype)
        for start in range(0, L, block_size):
            t = min(block_size, L - start)
            if layout == "head-major":
                k, v = K[:, start:start + t], V[:, start:start + t]
            elif layout == "token-major":
                k = torch.randn(t, n_kv, hs).to(dtype).permute(1, 0, 2)
                v = torch.randn(t, n_kv, hs).to(dtype).permute(1, 0, 2)
            else:
                k = torch.randn(n_kv, t, hs + 32).to(dtype)[:, :, 16:16 + hs]
                v = torch.randn(n_kv, t, hs + 32).to(dtype)[:, :, 16:16 + hs]
            kb.append(k)
            vb.append(v)
        ks.append(kb)
        vs.append(vb)
    return ks, vs


def check(out, lse, ref_out, ref_lse, tol=1e-4):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("hs", [64, 128])
def test_matches_float64_reference(kernel_mode, dtype, group, hs):
    n_kv = 2
    lengths = [0, 1, 37, 64, 300]  # no blocks, one token, one partial block, one full block, several
    ks, vs = make_blocks(lengths, n_kv, hs, 64, dtype, "head-major")
    q = torch.randn(len(lengths), n_kv * group, hs).to(dtype)
    out = torch.full((len(lengths), n_kv * group, hs), math.nan)  # poisoned: every element must be written
    lse = torch.full((len(lengths), n_kv * group), math.nan)
    attend_blocks(q, ks, vs, out=out, lse=lse, threads=2)
    ref_out, ref_lse = reference(q[:, :, None], ks, vs, hs ** -0.5)
    check(out, lse, ref_out[:, :, 0], ref_lse[:, :, 0])
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)  # the empty sequence


@pytest.mark.parametrize("layout", ["token-major", "padded"])
def test_strided_block_views(kernel_mode, layout):
    n_kv, group, hs = 4, 4, 64
    ks, vs = make_blocks([100, 16], n_kv, hs, 16, torch.bfloat16, layout)
    assert not ks[0][0].is_contiguous()
    q = torch.randn(2, n_kv * group, hs, dtype=torch.float32)  # fp32 queries over bf16 KV
    out, lse = attend_blocks(q, ks, vs, scale=0.3)
    ref_out, ref_lse = reference(q[:, :, None], ks, vs, 0.3)
    check(out, lse, ref_out[:, :, 0], ref_lse[:, :, 0])


def test_head_dim_not_unit_stride_still_exact(kernel_mode):
    """A view whose head_dim is strided cannot be read by the native kernel: the torch path runs."""
    K = torch.randn(2, 40, 64, 2)[..., 0]  # stride 2 along head_dim
    V = torch.randn(2, 40, 64, 2)[..., 0]
    q = torch.randn(4, 64)
    out, lse = attend_blocks(q, [K], [V])
    ref_out, ref_lse = reference(q[None, :, None], [[K]], [[V]], 64 ** -0.5)
    check(out, lse, ref_out[0, :, 0], ref_lse[0, :, 0])


@pytest.mark.parametrize("n_kv,group,T,hs", [(8, 8, 3, 64), (2, 16, 1, 128), (4, 1, 5, 128)])
def test_many_query_rows_and_splits(kernel_mode, n_kv, group, T, hs):
    """T queries per sequence, row groups beyond 16 rows per head, several heads per item, and
    sequences long enough to be split over threads and merged by LSE."""
    lengths = [700, 130]
    ks, vs = make_blocks(lengths, n_kv, hs, 32, torch.bfloat16, "head-major")
    q = torch.randn(len(lengths), n_kv * group, T, hs).to(torch.bfloat16)
    ref_out, ref_lse = reference(q, ks, vs, 0.125)
    for threads in (1, 3):
        out, lse = attend_blocks(q, ks, vs, scale=0.125, threads=threads)
        assert out.shape == q.shape and out.dtype == torch.float32 and lse.shape == q.shape[:-1]
        check(out, lse, ref_out, ref_lse)


def test_long_views_of_a_head_major_arena(kernel_mode):
    """The unpinned region's layout: per layer (2, n_kv, arena, hs), a sequence's tokens one or two long
    views of it. Views are cut into pieces for the threads and merged by LSE; through the front door too."""
    from engine.kernels import attention_cpu

    n_kv, group, hs = 4, 8, 128
    arena = torch.randn(2, n_kv, 3000, hs).to(torch.bfloat16)
    ranges = [[(0, 1500)], [(1600, 2100), (2200, 2990)]]  # one long view; two views with gaps between
    ks = [[arena[0, :, a:b] for a, b in seq] for seq in ranges]
    vs = [[arena[1, :, a:b] for a, b in seq] for seq in ranges]
    q = torch.randn(2, n_kv * group, 1, hs).to(torch.bfloat16)
    ref_out, ref_lse = reference(q, ks, vs, hs ** -0.5)
    for threads in (1, 2, 7):
        out, lse = attend_blocks(q, ks, vs, threads=threads)
        check(out, lse, ref_out, ref_lse)
    out, lse = attention_cpu.attend_blocks(q, [list(zip(k, v)) for k, v in zip(ks, vs)], hs ** -0.5)
    check(out, lse, ref_out, ref_lse)


def test_single_sequence_form(kernel_mode):
    ks, vs = make_blocks([50], 1, 64, 64, torch.float16, "head-major")
    q = torch.randn(8, 64).to(torch.float16)
    out, lse = attend_blocks(q, ks[0], vs[0])
    assert out.shape == (8, 64) and lse.shape == (8,)
    ref_out, ref_lse = reference(q[None, :, None], ks, vs, 64 ** -0.5)
    check(out, lse, ref_out[0, :, 0], ref_lse[0, :, 0])


def test_block_table_from_pool(kernel_mode):
    """A pool (N, n_kv, bs, hs) and per-sequence block ids, as a KV region would keep them."""
    n_kv, bs, hs = 2, 16, 64
    k_pool = torch.randn(10, n_kv, bs, hs).to(torch.bfloat16)
    v_pool = torch.randn(10, n_kv, bs, hs).to(torch.bfloat16)
    ids, lengths = [[7, 2, 9], [4], []], [40, 16, 0]
    table = KVBlockTable.from_pool(k_pool, v_pool, ids, lengths)
    assert table.batch_size == 3 and table.rows.shape == (4, 7)
    ks = [[k_pool[i, :, :min(bs, L - j * bs)] for j, i in enumerate(blocks)] for blocks, L in zip(ids, lengths)]
    vs = [[v_pool[i, :, :min(bs, L - j * bs)] for j, i in enumerate(blocks)] for blocks, L in zip(ids, lengths)]
    q = torch.randn(3, 8, hs)
    out, lse = attend_blocks(q, table)
    ref_out, ref_lse = reference(q[:, :, None], ks, vs, hs ** -0.5)
    check(out, lse, ref_out[:, :, 0], ref_lse[:, :, 0])
    # Head-major pool (n_kv, N, bs, hs): the block dimension is 1.
    table = KVBlockTable.from_pool(k_pool.transpose(0, 1).contiguous(), v_pool.transpose(0, 1).contiguous(),
                                   ids, lengths, block_dim=1)
    out2, lse2 = attend_blocks(q, table)
    check(out2, lse2, ref_out[:, :, 0], ref_lse[:, :, 0])


def test_bad_inputs_raise_clear_errors():
    k = torch.randn(2, 8, 64)
    with pytest.raises(KernelInputError, match="n_kv"):
        attend_blocks(torch.randn(4, 64), [k, torch.randn(3, 8, 64)], [k, torch.randn(3, 8, 64)])
    with pytest.raises(KernelInputError, match="one of fp32/bf16/fp16"):
        attend_blocks(torch.randn(4, 64), [k, k.half()], [k, k.half()])
    with pytest.raises(KernelInputError, match="lists of blocks"):
        attend_blocks(torch.randn(2, 4, 64), [k, k], [k, k])
    with pytest.raises(KernelInputError, match="contiguous fp32"):
        attend_blocks(torch.randn(4, 64), [k], [k], out=torch.empty(4, 64, dtype=torch.float64))
    with pytest.raises(KernelInputError, match="does not fit"):
        attend_blocks(torch.randn(3, 64), [k], [k])  # 3 query heads over 2 KV heads
    with pytest.raises(KernelInputError, match="blocks of 16"):
        KVBlockTable.from_pool(torch.randn(4, 2, 16, 64), torch.randn(4, 2, 16, 64), [[0]], [20])
    with pytest.raises(KernelInputError, match=r"\[0, 4\)"):
        KVBlockTable.from_pool(torch.randn(4, 2, 16, 64), torch.randn(4, 2, 16, 64), [[0, 4]], [20])


def test_implementation_names_the_kernel(kernel_mode):
    name = attention_native.implementation()
    assert name == ("torch" if kernel_mode == "torch" else f"native-{kernel_mode}")


def test_front_door_names_the_native_kernel():
    """attention_cpu serves every call with the native kernel when the extension loaded, and says so."""
    from engine.kernels import attention_cpu

    if attention_native.implementation() == "torch":
        pytest.skip("the native extension is not built")
    assert attention_cpu.implementation(torch.bfloat16, 32, 4, 128) == "native"
    assert attention_cpu.kernel_name(torch.bfloat16, 32, 4, 128) == attention_native.implementation()


def rising_blocks(lengths, n_kv, hs, block_size, dtype, step):
    """Block-major pool blocks whose keys grow along the sequence (key t scaled by 1 + step·t), so
    the scores' maximum keeps rising tile after tile: the softmax reference moves many times."""
    ks, vs = [], []
    for L in lengths:
        grow = (1 + step * torch.arange(L, dtype=torch.float32))[None, :, None]
        K, V = (torch.randn(n_kv, L, hs) * grow).to(dtype), torch.randn(n_kv, L, hs).to(dtype)
        ks.append([K[:, a:a + block_size] for a in range(0, L, block_size)])
        vs.append([V[:, a:a + block_size] for a in range(0, L, block_size)])
    return ks, vs


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("hs", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rising_and_falling_scores_stay_exact(kernel_mode, group, hs, dtype):
    """Scores spanning hundreds of log2 units, rising then falling: the lazily moved softmax reference
    (and the rescale of o and l it triggers) must give the exact result; lengths are not multiples of
    the block or tile size, and sequences with no block and with a single block are in the batch."""
    n_kv = 2
    lengths = [0, 23, 333, 64 * 9 + 5]
    ks, vs = rising_blocks(lengths, n_kv, hs, 64, dtype, step=0.05)
    ks[2], vs[2] = [k.flip(1) for k in reversed(ks[2])], [v.flip(1) for v in reversed(vs[2])]  # falling
    q = torch.randn(len(lengths), n_kv * group, 1, hs).to(dtype)
    ref_out, ref_lse = reference(q, ks, vs, 0.5)
    for threads in (1, 3):
        out, lse = attend_blocks(q, ks, vs, scale=0.5, threads=threads)
        check(out, lse, ref_out, ref_lse, tol=2e-4)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("hs", [64, 128])
def test_shuffled_pool_with_many_blocks(kernel_mode, group, hs):
    """Prefetching follows the walk across blocks lying anywhere in a pool, in both pool layouts, and
    across the pieces threads get: long sequences of shuffled blocks, partly filled last blocks."""
    n_kv, bs, n_pool = 2, 16, 160
    k_pool = torch.randn(n_pool, n_kv, bs, hs).to(torch.bfloat16)
    v_pool = torch.randn(n_pool, n_kv, bs, hs).to(torch.bfloat16)
    order = torch.randperm(n_pool)
    lengths = [16 * 70 + 3, 1, 16 * 50, 0]
    ids = [order[:71], order[71:72], order[72:122], order[122:122]]
    ks = [[k_pool[int(i), :, :min(bs, L - j * bs)] for j, i in enumerate(blocks)] for blocks, L in zip(ids, lengths)]
    vs = [[v_pool[int(i), :, :min(bs, L - j * bs)] for j, i in enumerate(blocks)] for blocks, L in zip(ids, lengths)]
    q = torch.randn(len(lengths), n_kv * group, 1, hs).to(torch.bfloat16)
    ref_out, ref_lse = reference(q, ks, vs, hs ** -0.5)
    for block_dim, (kp, vp) in ((0, (k_pool, v_pool)),
                                (1, (k_pool.transpose(0, 1).contiguous(), v_pool.transpose(0, 1).contiguous()))):
        table = KVBlockTable.from_pool(kp, vp, ids, lengths, block_dim=block_dim)
        for threads in (1, 2, 5):
            out, lse = attend_blocks(q, table, threads=threads)
            check(out, lse, ref_out, ref_lse)


@pytest.mark.skipif(attention_native.native.module() is None, reason="no native extension")
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_attend_rows_reads_a_slice_of_the_cache_in_place(kv_dtype):
    """A resident CPU decode step: rows [5, 300) of a (slots, n_kv, hs) cache, GQA 9 heads over 3."""
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(400, 3, 64, generator=g).to(kv_dtype) for _ in range(2))
    q = torch.randn(1, 9, 1, 64, generator=g)
    out = attention_native.attend_rows(q, k_cache, v_cache, slice(5, 300), 0.125)
    ref, _ = reference(q, [[k_cache[5:300].transpose(0, 1)]], [[v_cache[5:300].transpose(0, 1)]], 0.125)
    assert out.shape == (1, 9, 1, 64)
    assert torch.allclose(out.double(), ref, atol=2e-3 if kv_dtype != torch.float32 else 1e-5)


def test_attend_rows_declines_what_the_kernel_does_not_take():
    k_cache = v_cache = torch.zeros(8, 1, 24)
    assert attention_native.attend_rows(torch.zeros(1, 2, 1, 24), k_cache, v_cache, slice(0, 4), 1.0) is None  # head dim
    k_cache = v_cache = torch.zeros(8, 1, 64)
    q16 = torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16)
    assert attention_native.attend_rows(q16, k_cache, v_cache, slice(0, 4), 1.0) is None  # q not fp32
    assert attention_native.attend_rows(torch.zeros(1, 2, 1, 64), k_cache, v_cache, slice(2, 2), 1.0) is None  # no rows
