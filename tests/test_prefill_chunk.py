"""Tokens per prefill forward: larger where no attention layer makes (nh, T, S) scores (flash on CUDA,
sinks and sliding windows included),
the bounded size elsewhere, and the same logits whichever size a prompt is read in."""
from dataclasses import replace

import pytest
import torch

from engine.kv.resident import ResidentKV
from engine.models.common import ModelArgs
from engine.runtime.generator import FLASH_PREFILL_CHUNK, PREFILL_CHUNK, prefill_chunk

PLAIN = ModelArgs(arch="qwen3_moe", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _kv(device: str, dtype=torch.bfloat16, head_dim: int = 16) -> ResidentKV:
    return ResidentKV(2, 2, head_dim, max_context=256, max_batch=1, block_size=16, device=torch.device(device),
                      dtype=dtype)


def test_the_cpu_reads_a_prompt_in_bounded_forwards():
    assert not _kv("cpu").flash_prefill  # its prefill attention makes fp32 scores under a boolean mask
    assert prefill_chunk(PLAIN, _kv("cpu")) == PREFILL_CHUNK
    assert prefill_chunk(None, _kv("cpu")) == PREFILL_CHUNK  # a model without args


@pytest.mark.parametrize("variant", [{}, {"attn_sinks": True}, {"sliding_window": 128}, {"layer_windows": [128, None]}])
def test_attention_through_flash_reads_the_larger_forward_sinks_and_windows_included(variant):
    class FlashKV(ResidentKV):  # the CUDA resident KV's answer, on this machine's CPU
        flash_prefill = True

    kv = FlashKV(2, 2, 16, max_context=256, max_batch=1, block_size=16, device=torch.device("cpu"),
                 dtype=torch.float32)
    assert prefill_chunk(replace(PLAIN, **variant), kv) == FLASH_PREFILL_CHUNK
    assert prefill_chunk(replace(PLAIN, attention_layers=[1]), kv) == PREFILL_CHUNK  # recurrent layers


@pytest.mark.parametrize("dtype, head_dim, flash", [(torch.bfloat16, 16, True), (torch.float16, 128, True),
                                                    (torch.float32, 16, False), (torch.bfloat16, 512, False)],
                         ids=["bf16", "fp16-128", "fp32", "hs512"])
@pytest.mark.cuda
@needs_cuda
def test_a_cuda_resident_kv_attends_without_scores_where_flash_takes_it(dtype, head_dim, flash):
    kv = _kv("cuda", dtype, head_dim)
    assert kv.flash_prefill is flash
    assert prefill_chunk(PLAIN, kv) == (FLASH_PREFILL_CHUNK if flash else PREFILL_CHUNK)


def test_a_prompt_read_in_forwards_of_any_size_gives_the_same_logits(moe_engine):
    """The generator's forward size changes how a prompt is cut, not what its last logits are."""
    from engine.api import GenerationRequest

    gen = moe_engine.backend.generator
    prompt = [(i * 37 + 11) % 200 + 5 for i in range(150)]
    runs = []
    for size in (gen.prefill_chunk, 64, 40):
        gen.prefill_chunk = size
        req = GenerationRequest(prompt_ids=prompt, max_new_tokens=4, greedy=True, ignore_eos=True)
        runs.append(moe_engine.generate_batch([req])[0].token_ids)
    gen.prefill_chunk = prefill_chunk(getattr(gen.model, "args", None), gen.kv)
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.cuda
@needs_cuda
def test_a_cuda_engine_reads_long_prompts_in_flash_sized_forwards():
    """The default engine on a GPU picks the larger forward, and a prompt past one forward's size reads
    through in two (the second attends over the first's keys with the bottom-right causal bias)."""
    from engine.api import Engine, EngineConfig, GenerationRequest

    engine = Engine(EngineConfig(model="synthetic:qwen3-30b-a3b-L1", backend="tandem", device="cuda",
                                 dtype="bfloat16", max_context=4096, max_batch=1))
    try:
        assert engine.backend.generator.prefill_chunk == FLASH_PREFILL_CHUNK
        prompt = [(i * 37 + 11) % 200 + 5 for i in range(FLASH_PREFILL_CHUNK + 300)]
        res = engine.generate_batch([GenerationRequest(prompt_ids=prompt, max_new_tokens=4, greedy=True,
                                                       ignore_eos=True)])[0]
        assert res.prefilled_tokens == len(prompt) and len(res.token_ids) == 4
    finally:
        engine.close()
