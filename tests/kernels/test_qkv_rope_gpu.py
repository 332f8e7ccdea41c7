"""One fused q/k/v projection and the one-kernel norms + RoPE (Triton) against the three projections and
the reference torch code, interpreted on the CPU (compiled on CUDA where present)."""

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import qkv_rope_gpu  # noqa: E402
from engine.models.common import Attention, ModelArgs, rope_tables  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _attention(n_heads: int, n_kv: int, hs: int, qk_norm: bool, bias: bool, scope: str = "head",
               clip=None, dtype=torch.float32, seed: int = 0) -> Attention:
    args = ModelArgs(arch="t", vocab_size=8, dim=48, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hs,
                     ffn_dim=8, qk_norm=qk_norm, qk_norm_scope=scope, qkv_bias=bias, clip_qkv=clip, norm_eps=1e-5)
    attn = Attention(args, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in attn.parameters():  # norms away from 1 as well, so that a swapped weight shows
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 1.0))
    return attn.to(device=DEVICE, dtype=dtype)


def _rope(B: int, T: int, hs: int, dtype):
    gen = torch.Generator().manual_seed(B * 7 + T)
    cos_t, sin_t = rope_tables(hs, 10000.0, 64, DEVICE, dtype)
    positions = torch.randint(0, 64, (B, T), generator=gen).to(DEVICE)
    return cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)  # (B, 1, T, hs) each


@pytest.mark.parametrize("B,T,nh,n_kv,hs,qk_norm,bias", [
    (1, 1, 4, 4, 16, True, False),  # GQA ratio 1
    (2, 3, 8, 2, 32, True, False),  # ratio 4
    (1, 2, 16, 2, 64, False, True),  # ratio 8, no norm (Llama-like), biases (Qwen2-like)
    (3, 1, 6, 3, 16, True, True),  # head counts that are not powers of two
])
def test_fused_projection_norms_and_rope_match_the_three_projections(B, T, nh, n_kv, hs, qk_norm, bias):
    attn = _attention(nh, n_kv, hs, qk_norm, bias, seed=B + nh)
    x = torch.randn(B, T, 48, generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))).to(DEVICE)
    cos, sin = _rope(B, T, hs, torch.float32)
    ref = [t.clone() for t in attn._qkv(x, cos, sin)]  # (B, nh, T, hs), (B, n_kv, T, hs) ×2
    attn.fuse_qkv()
    got = list(attn._qkv_fused(x, cos, sin))
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-5), (g - r).abs().max()


@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (2, 2)])
def test_store_writes_k_and_v_into_their_cache_rows(B, T):
    """With a KV backend's decode_store the kernel writes k and v to rows[b·T + t] of the caches and
    returns None for them: the same values the unfused path stores, the other rows untouched."""
    attn = _attention(8, 2, 32, True, False, seed=3)
    attn.fuse_qkv()
    x = torch.randn(B, T, 48, generator=torch.Generator().manual_seed(B + T)).to(DEVICE)
    cos, sin = _rope(B, T, 32, torch.float32)
    q_ref, k_ref, v_ref = attn._qkv_fused(x, cos, sin)  # (B, nh, T, hs), (B, n_kv, T, hs) ×2
    k_cache = torch.full((9, 2, 32), 7.0, device=DEVICE)
    v_cache = torch.full((9, 2, 32), 7.0, device=DEVICE)
    rows = torch.tensor([5, 0, 8, 3][:B * T], device=DEVICE)
    q, k, v = attn._qkv_fused(x, cos, sin, (k_cache, v_cache, rows))
    assert k is None and v is None and torch.equal(q, q_ref)
    for cache, ref in ((k_cache, k_ref), (v_cache, v_ref)):
        assert torch.equal(cache[rows], ref.transpose(1, 2).reshape(B * T, 2, 32))
        untouched = torch.ones(9, dtype=torch.bool)
        untouched[rows.cpu()] = False
        assert (cache[untouched.to(DEVICE)] == 7.0).all()


def test_fuse_qkv_makes_the_three_weights_views_of_one_tensor_and_changes_no_value():
    attn = _attention(4, 2, 16, True, True)
    before = {k: v.clone() for k, v in attn.state_dict().items()}
    attn.fuse_qkv()
    after = attn.state_dict()
    assert before.keys() == after.keys()  # the fused tensors stay out of the state dict
    assert all(torch.equal(before[k], after[k]) for k in before)
    base = attn.qkv_weight.untyped_storage().data_ptr()
    for p in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert p.weight.untyped_storage().data_ptr() == base and p.bias.untyped_storage().data_ptr() == \
            attn.qkv_bias.untyped_storage().data_ptr()
    assert attn.qkv_weight.shape == ((4 + 2 * 2) * 16, 48)


@pytest.mark.parametrize("scope,clip", [("all", None), ("head", 2.0)])
def test_whole_projection_norms_and_clipping_keep_three_projections(scope, clip):
    attn = _attention(4, 2, 16, True, False, scope=scope, clip=clip)
    attn.fuse_qkv()
    assert attn.qkv_weight is None


def test_available_only_for_contiguous_gpu_tensors_of_the_tables_dtype():
    cos, _ = _rope(1, 1, 16, torch.float32)
    qkv = torch.randn(1, 1, 128, device=DEVICE)
    assert qkv_rope_gpu.available(qkv, cos) == (DEVICE.type == "cuda")
    assert not qkv_rope_gpu.available(qkv.to(torch.float64), cos)
    assert not qkv_rope_gpu.available(torch.randn(2, 1, 256, device=DEVICE)[..., ::2], cos)  # strided rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter mis-casts fp32 to bf16")
def test_bf16_rounds_like_the_reference():
    attn = _attention(32, 4, 128, True, False, dtype=torch.bfloat16, seed=5)
    x = torch.randn(2, 1, 48, device=DEVICE).to(torch.bfloat16)
    cos, sin = _rope(2, 1, 128, torch.bfloat16)
    ref = [t.clone() for t in attn._qkv(x, cos, sin)]
    attn.fuse_qkv()
    got = list(attn._qkv_fused(x, cos, sin))
    # one GEMM instead of three may sum in another order, and RoPE's products may stay in fp32 up to
    # the sum (rope_gpu): a few bf16 steps at most
    for g, r in zip(got, ref):
        assert torch.allclose(g.float(), r.float(), rtol=3e-2, atol=3e-2)
