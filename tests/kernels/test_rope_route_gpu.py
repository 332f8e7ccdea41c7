"""The one-kernel RoPE and router (Triton) against the reference torch code, interpreted on the CPU
(compiled on CUDA where present)."""

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import rope_gpu, route_gpu  # noqa: E402
from engine.models.common import apply_rope, rope_tables  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("B,T,heads,hs", [(1, 1, 4, 16), (2, 3, 6, 32), (1, 5, 1, 64), (3, 1, 32, 128)])
def test_rope_matches_the_reference_fp32(B, T, heads, hs):
    gen = torch.Generator().manual_seed(B * 100 + heads)
    cos_t, sin_t = rope_tables(hs, 10000.0, 64, DEVICE, torch.float32)
    positions = torch.randint(0, 64, (B, T), generator=gen).to(DEVICE)
    cos, sin = cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)  # (B, 1, T, hs)
    x = torch.randn(B, T, heads, hs, generator=gen).to(DEVICE)
    y = rope_gpu.rope(x, cos, sin)
    ref = apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
    assert torch.allclose(y, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter mis-casts fp32 to bf16")
def test_rope_bf16_rounds_like_the_reference():
    cos_t, sin_t = rope_tables(128, 1e6, 4096, DEVICE, torch.bfloat16)
    positions = torch.tensor([[7], [4000]], device=DEVICE)
    cos, sin = cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)
    x = torch.randn(2, 1, 32, 128, device=DEVICE).to(torch.bfloat16)
    y, ref = rope_gpu.rope(x, cos, sin), apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
    # The compiler may keep the two products in fp32 before the sum (seen on the H200): then an
    # element can land one bf16 step away from the reference's twice-rounded value.
    assert torch.allclose(y.float(), ref.float(), rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("N,E,k,renorm", [(1, 8, 2, True), (3, 128, 8, True), (4, 60, 4, False), (2, 5, 5, True)])
def test_route_matches_softmax_topk(N, E, k, renorm):
    gen = torch.Generator().manual_seed(N * E + k)
    logits = torch.randn(N, E, generator=gen).to(DEVICE)
    w, ids = route_gpu.softmax_topk(logits, k, renorm)
    probs = torch.softmax(logits.float(), -1)
    ref_w, ref_ids = torch.topk(probs, k, dim=-1)
    if renorm:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)


def test_route_breaks_ties_to_the_lower_index():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0]], device=DEVICE)
    _, ids = route_gpu.softmax_topk(logits, 3, True)
    assert ids.tolist() == [[1, 2, 4]]
