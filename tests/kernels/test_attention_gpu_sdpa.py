"""attention_gpu.sdpa: the KV caches' prefill attention goes through torch's SDPA with its cuDNN backend
switched off (cuDNN plans every new prompt and chunk shape: a second-long stall on a new prompt length
on an H100), and computes what SDPA computes: causal, masked, grouped-query."""

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import attention_gpu


def test_sdpa_runs_with_cudnn_attention_switched_off(monkeypatch):
    """On CUDA tensors; checked here on CPU tensors that claim to be on CUDA (the flag is host state)."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    attention_gpu.sdpa(q, k, k, causal=True)
    assert seen == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # the process's setting, restored on the way out


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_equals_grouped_query_attention(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g),
               torch.randn(2, 2, 9, 16, generator=g))
    mask = None if causal else torch.rand(2, 1, 6, 9, generator=g) > 0.3
    if mask is not None:
        mask[..., 0] = True  # every query sees a key
    got = attention_gpu.sdpa(q, k[:, :, -6:] if causal else k, v[:, :, -6:] if causal else v, mask, causal=causal)
    kk, vv = (t.repeat_interleave(2, dim=1) for t in ((k[:, :, -6:], v[:, :, -6:]) if causal else (k, v)))
    want = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sdpa_on_the_cpu_sets_no_backend_context(monkeypatch):
    """A CPU decode step calls it every layer: no context manager's cost there."""
    from engine.kernels import attention_gpu as module

    monkeypatch.setattr(module, "sdpa_kernel", None)  # calling it would fail
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 5, 16)
    assert attention_gpu.sdpa(q, k, k).shape == (1, 4, 1, 16)
