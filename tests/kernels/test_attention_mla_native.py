"""MLA decode over latent rows kept as two planes (engine/kernels/attention_mla_native.py) against
attention_mla.latent_attention_planes in float64 over the same rows gathered, for every native ISA of
this CPU and the torch fallback (the kernel_mode fixture). Inputs are fresh random tensors each run.

Tolerance: the kernel widens every row to fp32 and accumulates in fp32 over ≤ 2,000 rows with scores
of O(1–10) (scale 0.07 on dot products of 2·w unit normals), in another summation order than the
reference: its error against float64 is fp32 rounding, observed ≲ 1e-5. Allowed 1e-4 absolute on
outputs of O(0.1–1) and on LSEs of O(10).
"""

import math

import pytest
import torch

from engine.errors import KernelInputError
from engine.kernels import attention_mla, attention_mla_native
from engine.kernels.attention_mla_native import attend_latent_blocks

TOL = 1e-4
SCALE = 0.07


def region(n_tokens, w, dtype, pad=3):
    """Rows as the hybrid format holds them: (tokens, 2 planes, w + pad), the planes of a token
    adjacent; `pad` columns after each plane make every stride odd (w + pad, 2·(w + pad))."""
    return torch.randn(n_tokens, 2, w + pad).to(dtype)


def views_of(buf, runs, w):
    """(k, v) plane views (1, t, w) of the runs [a, b) of `buf`, in token order."""
    return [(buf[a:b, 0, :w].unsqueeze(0), buf[a:b, 1, :w].unsqueeze(0)) for a, b in runs]


def reference(q, seqs, value_dim, scale):
    """float64 over each sequence's runs gathered → o (B, nh, T, r), lse (B, nh, T)."""
    B, nh, T, _ = q.shape
    out = torch.zeros(B, nh, T, value_dim, dtype=torch.float64)
    lse = torch.full((B, nh, T), -math.inf, dtype=torch.float64)
    for b, views in enumerate(seqs):
        views = [(k, v) for k, v in views if k.shape[1]]
        if not views:
            continue
        k = torch.cat([k for k, _ in views], 1).double().unsqueeze(0)  # (1, 1, S, w)
        v = torch.cat([v for _, v in views], 1).double().unsqueeze(0)
        out[b:b + 1], lse[b:b + 1] = attention_mla.latent_attention_planes(q[b:b + 1].double(), k, v, value_dim, scale)
    return out, lse


def check(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, rtol=TOL, atol=TOL)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=TOL, atol=TOL)


# DeepSeek-V2's row (r 512 + dr 64 → planes of 288, values into the second plane); a tiny model's
# (16 + 4 → 10: no whole vector, every column a scalar tail); values ending inside the first plane.
WIDTHS = [(288, 512), (10, 16), (40, 30)]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("w,r", WIDTHS)
def test_matches_float64_reference(kernel_mode, kv_dtype, T, w, r):
    """Sequences of no rows, one row, an odd count in several runs with gaps, and a long one."""
    nh = 16
    buf = region(2400, w, kv_dtype)
    runs = [[], [(5, 6)], [(10, 47), (60, 61), (70, 333)], [(400, 2400)]]
    seqs = [views_of(buf, rr, w) for rr in runs]
    q = torch.randn(len(runs), nh, T, 2 * w)
    ref_out, ref_lse = reference(q, seqs, r, SCALE)
    for threads in (1, 3):
        out = torch.full((len(runs), nh, T, r), math.nan)  # poisoned: every element must be written
        lse = torch.full((len(runs), nh, T), math.nan)
        attend_latent_blocks(q, seqs, r, SCALE, out=out, lse=lse, threads=threads)
        check(out, lse, ref_out, ref_lse)
        assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)  # the empty sequence


@pytest.mark.parametrize("nh,T", [(128, 1), (48, 2), (3, 1)])
def test_query_rows_beyond_one_item_and_bf16_queries(kernel_mode, nh, T):
    """More query rows than one item holds (DeepSeek-V2's 128 heads; 96 rows) split into row groups,
    a head count no register block divides; bf16 queries (the exchange hands the KV dtype over)."""
    w, r = 288, 512
    buf = region(700, w, torch.bfloat16, pad=0)
    seqs = [views_of(buf, [(0, 650)], w), views_of(buf, [(100, 233)], w)]
    q = torch.randn(2, nh, T, 2 * w).to(torch.bfloat16)
    ref_out, ref_lse = reference(q, seqs, r, SCALE)
    for threads in (1, 2):
        out, lse = attend_latent_blocks(q, seqs, r, SCALE, threads=threads)
        assert out.shape == (2, nh, T, r) and out.dtype == torch.float32 and lse.shape == (2, nh, T)
        check(out, lse, ref_out, ref_lse)


def test_prepared_table_and_no_rows_at_all(kernel_mode):
    """prepare() once, attend again and again (each layer's CPU share between flushes); a batch
    without any rows gives 0 and −inf everywhere."""
    w, r = 40, 64
    buf = region(300, w, torch.bfloat16)
    seqs = [views_of(buf, [(0, 100), (150, 299)], w)]
    table = attention_mla_native.prepare(seqs)
    assert attention_mla_native.runs_natively(table) == (kernel_mode != "torch")
    for _ in range(2):
        q = torch.randn(1, 8, 1, 2 * w)
        check(*attend_latent_blocks(q, table, r, SCALE), *reference(q, seqs, r, SCALE))
    out, lse = attend_latent_blocks(torch.randn(2, 8, 1, 2 * w), [[], []], r, SCALE)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_strided_last_dim_runs_the_torch_path(kernel_mode):
    """Planes whose columns are not unit-stride cannot be read natively: the torch path gives the same."""
    w, r = 32, 48
    buf = torch.randn(90, 2, w, 2)[..., 0]  # stride 2 along the columns
    seqs = [[(buf[:, 0].unsqueeze(0), buf[:, 1].unsqueeze(0))]]
    table = attention_mla_native.prepare(seqs)
    assert not attention_mla_native.runs_natively(table)
    q = torch.randn(1, 4, 1, 2 * w)
    check(*attend_latent_blocks(q, table, r, SCALE), *reference(q, seqs, r, SCALE))


def test_shapes_are_checked():
    w = 16
    seqs = [views_of(region(20, w, torch.float32), [(0, 20)], w)]
    with pytest.raises(KernelInputError):
        attend_latent_blocks(torch.randn(1, 4, 1, 2 * w + 1), seqs, 16, SCALE)  # odd row width
    with pytest.raises(KernelInputError):
        attend_latent_blocks(torch.randn(1, 4, 1, 2 * w), seqs, 2 * w + 1, SCALE)  # values past the row
    with pytest.raises(KernelInputError):
        attend_latent_blocks(torch.randn(2, 4, 1, 2 * w), seqs, 16, SCALE)  # two queries, one sequence
    with pytest.raises(KernelInputError):
        attend_latent_blocks(torch.randn(1, 4, 1, 2 * w + 2), seqs, 16, SCALE)  # planes of another width
