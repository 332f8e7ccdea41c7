"""The CPU's native norms and RoPE (engine/kernels/layer_ops_cpu.py) against the torch ops they stand
in for: the same formulas in fp32, so they agree to a few ulps (the sum of squares is added in another
order; the RoPE products may be fused)."""

import pytest
import torch

from engine.kernels import layer_ops_cpu, native
from engine.models.common import RMSNorm, apply_partial_rope, apply_rope, rope_tables

pytestmark = pytest.mark.skipif(not layer_ops_cpu.available(torch.zeros(1)), reason="no native extension")


def _norm_ref(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 37), (130, 2048)])  # 130 rows: split over threads
def test_rms_norm_matches_torch(rows, dim):
    g = torch.Generator().manual_seed(dim)
    x, w = torch.randn(rows, dim, generator=g) * 4, torch.randn(dim, generator=g)
    assert torch.allclose(layer_ops_cpu.rms_norm(x, w, 1e-6), _norm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    wide = torch.randn(rows, dim + 9, generator=g)[:, :dim]  # rows further apart than dim
    assert torch.allclose(layer_ops_cpu.rms_norm(wide, w, 1e-6), _norm_ref(wide, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_add_rms_norm_returns_the_sum_and_its_norm():
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(2, 5, 96, generator=g), torch.randn(2, 5, 96, generator=g), torch.randn(96, generator=g)
    h, out = layer_ops_cpu.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, x + r)
    assert torch.allclose(out, _norm_ref(x + r, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_the_model_norm_takes_the_native_call_on_cpu_fp32():
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64)
    x = torch.randn(1, 1, 64)
    assert torch.allclose(norm(x), _norm_ref(x, norm.weight, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rotary", [64, 32])  # whole heads, and GLM's partial RoPE
def test_rope_in_place_matches_apply_rope(rotary):
    B, T, nh, n_kv, hs = 2, 3, 4, 2, 64
    cos_t, sin_t = rope_tables(rotary, 10000.0, 16, "cpu", torch.float32)
    pos = torch.tensor([[0, 1, 2], [7, 8, 9]])
    cos, sin = cos_t[pos].unsqueeze(1), sin_t[pos].unsqueeze(1)  # (B, 1, T, rd)
    qkv = torch.randn(B, T, (nh + 2 * n_kv) * hs, generator=torch.Generator().manual_seed(rotary))
    q = qkv[..., :nh * hs].view(B, T, nh, hs)  # a column slice of a fused projection: strided tokens
    k = qkv[..., nh * hs:(nh + n_kv) * hs].view(B, T, n_kv, hs)
    rope = apply_rope if rotary == hs else apply_partial_rope
    want_q, want_k = (rope(t.transpose(1, 2), cos, sin).transpose(1, 2) for t in (q, k))
    v_before = qkv[..., (nh + n_kv) * hs:].clone()
    assert layer_ops_cpu.rope_fits(q, cos) and layer_ops_cpu.rope_fits(k, cos)
    layer_ops_cpu.rope_(q, cos, sin), layer_ops_cpu.rope_(k, cos, sin)
    assert torch.allclose(q, want_q, atol=1e-5) and torch.allclose(k, want_k, atol=1e-5)
    assert torch.equal(qkv[..., (nh + n_kv) * hs:], v_before)  # v, beside them, untouched


def test_rope_fits_refuses_layouts_it_cannot_walk():
    cos = torch.zeros(1, 1, 2, 64)
    assert not layer_ops_cpu.rope_fits(torch.zeros(1, 4, 2, 64).transpose(1, 2), cos)  # heads apart
    assert not layer_ops_cpu.rope_fits(torch.zeros(1, 2, 4, 32), cos)  # rotary wider than the head


def test_native_rope_checks_its_arguments():
    nat, x = native.module(), torch.zeros(2, 64)
    with pytest.raises(ValueError, match="rotary even"):
        nat.rope_rotate_half(x.data_ptr(), 1, 64, 1, 64, 63, x.data_ptr(), x.data_ptr(), 1)
    with pytest.raises(ValueError, match="token_stride"):
        nat.rope_rotate_half(x.data_ptr(), 2, 32, 1, 64, 64, x.data_ptr(), x.data_ptr(), 1)
