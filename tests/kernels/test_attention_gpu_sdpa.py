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


CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("device,dtype", [pytest.param("cpu", torch.float32, id="cpu"),
                                          pytest.param("cuda", torch.bfloat16, marks=CUDA, id="cuda-bf16")])
@pytest.mark.parametrize("T,S", [(7, 19), (512, 2048)])
def test_a_chunk_after_earlier_ones_attends_bottom_right(T, S, device, dtype):
    """A prefill chunk of T queries after S − T cached keys (grouped-query heads): torch's bottom-right
    causal bias (flash on CUDA) gives what the boolean mask gives (the math backend)."""
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, T, 64, generator=g).to(device, dtype)
    k, v = (torch.randn(1, 2, S, 64, generator=g).to(device, dtype) for _ in range(2))
    visible = (torch.arange(S)[None, :] <= (S - T + torch.arange(T))[:, None])[None, None].to(device)  # (1, 1, T, S)
    got = attention_gpu.sdpa(q, k, v, causal_lower_right(T, S)).float()
    want = attention_gpu.sdpa(q, k, v, visible).float()
    assert (got - want).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)


def test_a_bias_the_kernels_refuse_falls_back_to_the_boolean_mask_for_good(monkeypatch, caplog):
    import logging

    from torch.nn.attention.bias import causal_lower_right

    calls = []
    real = F.scaled_dot_product_attention

    def refusing(q, k, v, attn_mask=None, **kwargs):
        calls.append(type(attn_mask).__name__)
        if attn_mask is not None and type(attn_mask).__name__ == "CausalBias":
            raise RuntimeError("No available kernel. Aborting execution.\nmore")
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", refusing)
    monkeypatch.setattr(attention_gpu, "_bias_failed", None)
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 4, 3, 16, generator=g), torch.randn(1, 2, 8, 16, generator=g), torch.randn(1, 2, 8, 16)
    visible = (torch.arange(8)[None, :] <= (5 + torch.arange(3))[:, None])[None, None]
    want = real(q, k, v, attn_mask=visible, enable_gqa=True)
    with caplog.at_level(logging.WARNING, logger="tandem"):
        for _ in range(2):
            assert torch.allclose(attention_gpu.sdpa(q, k, v, causal_lower_right(3, 8)), want, atol=1e-6)
    assert calls == ["CausalBias", "Tensor", "Tensor"]  # refused once, then the mask straight away
    assert attention_gpu._bias_failed == "No available kernel. Aborting execution."
    assert sum("refused the causal bias" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("device,dtype", [pytest.param("cpu", torch.float32, id="cpu"),
                                          pytest.param("cuda", torch.bfloat16, marks=CUDA, id="cuda-bf16")])
@pytest.mark.parametrize("T,S", [(7, 7), (7, 19), (512, 2048)])
@pytest.mark.parametrize("form", ["none", "bias"])
def test_sinks_under_causal_attention_keep_bottom_right_alignment(T, S, form, device, dtype):
    """Causal attention with sinks, given as None or as the bottom-right bias a chunk after earlier ones
    gets on CUDA: the same as the boolean mask, and as the softmax with e^s in its denominator written out."""
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, T, 64, generator=g).to(device, dtype)
    k, v = (torch.randn(1, 2, S, 64, generator=g).to(device, dtype) for _ in range(2))
    sinks = torch.randn(8, generator=g).to(device)
    visible = (torch.arange(S)[None, :] <= (S - T + torch.arange(T))[:, None])[None, None].to(device)  # (1, 1, T, S)
    got = attention_gpu.sdpa_with_sinks(q, k, v, sinks, None if form == "none" else causal_lower_right(T, S)).float()
    want = attention_gpu.sdpa_with_sinks(q, k, v, sinks, visible).float()
    assert (got - want).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)
    scores = q.float() @ k.float().repeat_interleave(4, dim=1).transpose(-1, -2) * 64 ** -0.5  # (1, 8, T, S)
    scores = scores.masked_fill(~visible, float("-inf"))
    both = torch.cat((sinks.float()[None, :, None, None].expand(1, 8, T, 1), scores), dim=-1).softmax(-1)
    reference = both[..., 1:] @ v.float().repeat_interleave(4, dim=1)
    assert (got - reference).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)
