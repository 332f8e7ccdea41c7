"""The resident KV's paged decode (the Triton kernel over the block table, interpreted on the CPU)
decodes a batch of unequal prompts exactly like the gather path."""

import pytest
import torch

pytest.importorskip("triton")

from engine.kv.resident import ResidentKV  # noqa: E402

from test_kv_generation import PROMPT, assert_same_greedy, greedy, reference_logits  # noqa: E402


def test_paged_decode_is_chosen_only_where_it_runs():
    kv = ResidentKV(2, 2, 64, max_context=64, max_batch=1, block_size=16, device=torch.device("cpu"),
                    dtype=torch.float32)
    assert kv.paged is False  # the CPU keeps the gather path outside tests
    odd = ResidentKV(2, 2, 48, max_context=64, max_batch=1, block_size=16,
                     device=torch.device("cuda" if torch.cuda.is_available() else "cpu"), dtype=torch.float32)
    assert odd.paged is False  # head dims that are not powers of two never take the kernel
    tiny = ResidentKV(2, 2, 8, max_context=64, max_batch=1, block_size=16,
                      device=torch.device("cuda" if torch.cuda.is_available() else "cpu"), dtype=torch.float32)
    assert tiny.paged is False  # nor do heads narrower than the kernel's smallest tile


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only where there is no GPU; "
                    "CUDA generation goes through the kernel in the CUDA parity tests")
def test_paged_resident_decodes_a_batch_like_the_reference(dense_engine):
    parts = dense_engine.parts
    prompts = [dense_engine.render(PROMPT), dense_engine.tokenize("Once upon a time")]
    a = parts.args
    kv = ResidentKV(a.n_layers, a.n_kv_heads, a.head_dim, max_context=160, max_batch=2, block_size=16,
                    device=parts.device, dtype=parts.dtype, paged_decode=True)
    steps = {"paged": 0}
    real_attend = kv.attend

    def counting_attend(layer, q, k, v):
        steps["paged"] += kv._paged_step is not None
        return real_attend(layer, q, k, v)

    kv.attend = counting_attend
    tokens, tops = greedy(parts.model, kv, prompts, 6)
    assert steps["paged"] == 6 * a.n_layers  # every decode step of every layer took the kernel
    for b, p in enumerate(prompts):
        assert_same_greedy(p, tokens[b], [(v[b], i[b]) for v, i in tops], reference_logits(parts, p + tokens[b]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only where there is no GPU; "
                    "CUDA generation stores through the kernel in the CUDA parity tests")
def test_projection_kernel_stores_k_and_v_of_a_paged_decode_step(dense_engine, monkeypatch):
    """The fused q/k/v kernel (forced here, as on CUDA) writes each decode step's k and v into the rows
    decode_store names, attend gets None for them, and the tokens stay the reference's."""
    from engine.kernels import qkv_rope_gpu

    parts = dense_engine.parts
    prompts = [dense_engine.render(PROMPT), dense_engine.tokenize("Once upon a time")]
    a = parts.args
    for layer in parts.model.model.layers:
        if layer.self_attn.qkv_weight is None:
            layer.self_attn.fuse_qkv()
    monkeypatch.setattr(qkv_rope_gpu, "available", lambda x, cos: x.is_contiguous() and cos.is_contiguous())
    kv = ResidentKV(a.n_layers, a.n_kv_heads, a.head_dim, max_context=160, max_batch=2, block_size=16,
                    device=parts.device, dtype=parts.dtype, paged_decode=True)
    stored = {"n": 0}
    real_attend = kv.attend

    def counting_attend(layer, q, k, v):
        stored["n"] += k is None and v is None
        return real_attend(layer, q, k, v)

    kv.attend = counting_attend
    tokens, tops = greedy(parts.model, kv, prompts, 6)
    assert stored["n"] == 6 * a.n_layers  # every decode step of every layer stored through the kernel
    for b, p in enumerate(prompts):
        assert_same_greedy(p, tokens[b], [(v[b], i[b]) for v, i in tops], reference_logits(parts, p + tokens[b]))
