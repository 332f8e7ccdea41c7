"""The one-kernel RMSNorm (Triton) against the reference module, interpreted on the CPU (compiled on
CUDA where present)."""

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import rmsnorm_gpu  # noqa: E402
from engine.models.common import RMSNorm  # noqa: E402


def _reference(x, weight, eps):
    norm = RMSNorm(x.shape[-1], eps).to(x.device, x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    xf = x.float()  # the module's own arithmetic, whatever device the kernel ran on
    return norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 4, 16), (5, 100), (3, 0, 32)])
def test_rms_norm_matches_the_module_fp32(shape):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(device)
    w = torch.randn(shape[-1], generator=gen).to(device)
    y = rmsnorm_gpu.rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.allclose(y, _reference(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter mis-casts fp32 to bf16")
def test_rms_norm_bf16_rounds_like_the_module():
    x = torch.randn(64, 2048, device="cuda").to(torch.bfloat16)
    w = torch.randn(2048, device="cuda").to(torch.bfloat16)
    ref = _reference(x, w, 1e-6)
    y = rmsnorm_gpu.rms_norm(x, w, 1e-6)
    # only the fp32 sum of squares differs in order: at most one bf16 step apart, almost always equal
    assert torch.allclose(y.float(), ref.float(), rtol=8e-3, atol=1e-2)
    assert (y == ref).float().mean() > 0.99


def test_the_module_takes_the_kernel_only_on_cuda():
    norm = RMSNorm(16, 1e-5)
    x = torch.randn(2, 16)
    assert not rmsnorm_gpu.available(x, norm.weight)  # CPU tensors keep the reference arithmetic
    assert not rmsnorm_gpu.available(x.t(), norm.weight)


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 48), (3, 0, 32)])
def test_add_rms_norm_returns_the_residual_sum_and_its_norm(shape):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    x, r = ((torch.randn(shape, generator=gen) * 3).to(device) for _ in range(2))
    w = torch.randn(shape[-1], generator=gen).to(device)
    h, y = rmsnorm_gpu.add_rms_norm(x, r, w, 1e-6)
    assert torch.allclose(h, x + r, rtol=1e-6, atol=1e-6)
    assert torch.allclose(y, _reference(x + r, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter mis-casts fp32 to bf16")
def test_add_rms_norm_bf16_rounds_like_add_then_the_module():
    x, r = (torch.randn(8, 2048, device="cuda").to(torch.bfloat16) for _ in range(2))
    w = torch.randn(2048, device="cuda").to(torch.bfloat16)
    h, y = rmsnorm_gpu.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, x + r)
    ref = _reference(x + r, w, 1e-6)
    assert torch.allclose(y.float(), ref.float(), rtol=8e-3, atol=1e-2) and (y == ref).float().mean() > 0.99


def test_the_modules_add_forward_equals_add_then_norm_on_the_cpu():
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    h, y = norm.add_forward(x, r)
    assert torch.equal(h, x + r) and torch.equal(y, norm(x + r))
