"""Greedy generation with every hybrid KV policy equals resident KV on the built-in models (fp32,
simulate_hybrid: the "GPU side" on the CPU). The D-window and blocks are small so that decode
flushes every 16 tokens, host runs span several extents and the pinned share streams through the
ping-pong buffers in several chunks per layer.

A token that differs from the reference must be a near-tie of the reference's top two logits.
"""

import pytest
import torch

from engine.api import Engine, EngineConfig, GenerationRequest
from engine.errors import ConfigError, OutOfMemoryError
from engine.kv.inplace import PartitionSpec
from engine.kv.monolithic import MonolithicKV
from engine.kv.resident import ResidentKV
from engine.kv.writescope import WriteScopeKV
from engine.runtime.kv_setup import build_kv
from engine.sched.roofline import RooflineParams


NEAR_TIE = 1e-3  # logits: fp32 reorderings move them by ~1e-5
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def hybrid(parts, policy, max_context, max_batch=1, pingpong=128):
    a = parts.args
    if policy == "monolithic":
        return MonolithicKV(a.n_layers, a.n_kv_heads, a.head_dim, max_context=max_context, max_batch=max_batch,
                            device=parts.device, dtype=parts.dtype)
    spec = PartitionSpec(block_size=16, d_window=16, pingpong_tokens=pingpong,
                         roofline=RooflineParams(A_ns_per_token=600.0, B_ns_per_token=400.0, delta_ms=0.0))
    return WriteScopeKV(a.n_layers, a.n_kv_heads, a.head_dim, max_context=max_context, max_batch=max_batch,
                        device=parts.device, dtype=parts.dtype, spec=spec, policy=policy)


@torch.inference_mode()
def greedy(model, kv, prompts, n_steps, check=None):
    """Free-running greedy decode of a batch, EOS ignored: tokens per sequence, and each step's top-5."""
    sids = [kv.new_sequence() for _ in prompts]
    logits = []
    for sid, p in zip(sids, prompts):
        pos = kv.begin_step([sid], len(p))
        logits.append(model(torch.tensor([p]), pos, kv)[0])
        kv.end_step()
    logits = torch.stack(logits)  # (B, V)
    tokens, tops = [[] for _ in prompts], []
    for _ in range(n_steps):
        tops.append(logits.topk(5))
        nxt = logits.argmax(-1)
        for seq, t in zip(tokens, nxt.tolist()):
            seq.append(t)
        pos = kv.begin_step(sids, 1)
        logits = model(nxt[:, None], pos, kv)
        kv.end_step()
        if check is not None:
            check(kv)
    for sid in sids:
        kv.free(sid)
    return tokens, tops


@torch.inference_mode()
def reference_logits(parts, ids):
    """Resident KV, one causal pass over the whole sequence: the logits after every position."""
    kv = ResidentKV(parts.args.n_layers, parts.args.n_kv_heads, parts.args.head_dim, max_context=len(ids),
                    max_batch=1, block_size=16, device=parts.device, dtype=parts.dtype)
    sid, out = kv.new_sequence(), []
    for start in range(0, len(ids), 512):
        chunk = ids[start:start + 512]
        pos = kv.begin_step([sid], len(chunk))
        out.append(parts.model(torch.tensor([chunk]), pos, kv, last_only=False)[0])
        kv.end_step()
    return torch.cat(out)  # (len(ids), V)


def assert_same_greedy(prompt, tokens, tops, ref):
    """Every generated token is the reference's argmax after the same prefix, or a near-tie of it."""
    worst_gap = 0.0
    for i, (tok, (values, idx)) in enumerate(zip(tokens, tops)):
        row = ref[len(prompt) - 1 + i]
        best = int(row.argmax())
        if best != tok:
            gap = float(row[best] - row[tok])
            assert gap < NEAR_TIE, f"step {i}: took {tok}, the reference's argmax is {best} (gap {gap:.2e})"
        worst_gap = max(worst_gap, float((row[idx] - values).abs().max()))
    assert worst_gap < 1e-2, f"logits differ from the reference by {worst_gap:.2e}"


def test_writescope_decodes_1000_greedy_tokens_like_resident(dense_engine):
    parts = dense_engine.parts
    prompt = dense_engine.render(PROMPT)
    kv = hybrid(parts, "writescope", max_context=len(prompt) + 1024, pingpong=256)
    seen = {"flushes": 0, "max_chunks": 0, "max_window": 0}

    def check(kv):
        s = next(iter(kv.cache.seqs.values()))
        seen["flushes"] += s.window == 0
        seen["max_window"] = max(seen["max_window"], s.window)
        seen["max_chunks"] = max(seen["max_chunks"], len(s.pinned.extent_fills()))
        assert s.window + s.pinned.fill + s.unpinned.fill == s.length

    tokens, tops = greedy(parts.model, kv, [prompt], 1000, check)
    assert_same_greedy(prompt, tokens[0], tops, reference_logits(parts, prompt + tokens[0]))
    tel = kv.telemetry()
    assert seen["flushes"] >= 60 and seen["max_window"] <= 16
    assert tel["pcie"]["h2d_bytes"] > 0 or tel["tokens"]["unpinned"] > 0
    kv.close()


POLICIES = ["writescope", "gpu-centric", "cpu-centric", "fixed:0.4", "monolithic"]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_decodes_a_batch_like_resident(dense_engine, policy):
    parts = dense_engine.parts
    prompts = [dense_engine.render(PROMPT),
               dense_engine.render([{"role": "user", "content": "Name three colours of the rainbow."}]),
               dense_engine.tokenize("Once upon a time")]
    kv = hybrid(parts, policy, max_context=200, max_batch=3, pingpong=48)
    tokens, tops = greedy(parts.model, kv, prompts, 64)
    for b, p in enumerate(prompts):
        assert_same_greedy(p, tokens[b], [(v[b], i[b]) for v, i in tops], reference_logits(parts, p + tokens[b]))
    kv.close()


@pytest.mark.parametrize("policy", ["writescope", "fixed:0.5", "monolithic"])
def test_moe_model_decodes_like_resident(moe_engine, policy):
    parts = moe_engine.parts
    prompt = moe_engine.render(PROMPT)
    kv = hybrid(parts, policy, max_context=len(prompt) + 100, pingpong=32)
    tokens, tops = greedy(parts.model, kv, [prompt], 64)
    assert_same_greedy(prompt, tokens[0], tops, reference_logits(parts, prompt + tokens[0]))
    kv.close()


def test_writescope_is_the_default_when_the_kv_does_not_fit_the_budget():
    config = EngineConfig(model="builtin:smollm2-135m", device="cpu", simulate_hybrid=True, vram_budget_gb=0.6,
                          max_context=4096, max_batch=2, d_window=32, block_size=16)
    engine = Engine(config)
    try:
        assert engine.parts.kv.policy == "writescope"  # 0.54 GB of weights + 1.4 GiB of resident KV > 0.6 GB
        req = GenerationRequest(prompt="What is the capital of France?", max_new_tokens=40, greedy=True,
                                session_id="chat")
        res = engine.generate(req)
        assert "Paris" in res.text
        kv = engine.stats().to_dict()["kv"]
        assert kv["policy"] == "writescope"
        assert sum(v for v in kv["tokens"].values() if v) == res.prompt_tokens + res.completion_tokens - 1
        assert 0 <= kv["r_target"] <= 1 and kv["A_ns_per_token"] > 0 and kv["B_ns_per_token"] > 0
        host = engine.stats().host
        assert host["kv_pinned"] is not None and host["kv_unpinned"] is not None
    finally:
        engine.close()


def test_hybrid_policies_need_a_gpu_or_simulation(dense_engine):
    parts = dense_engine.parts
    config = EngineConfig(model="builtin:smollm2-135m", device="cpu", kv_policy="writescope", max_batch=4)
    with pytest.raises(ConfigError, match="simulate_hybrid"):
        build_kv(config, parts.args, parts.model, None, parts.device, parts.dtype, 256)
    config.simulate_hybrid = True
    kv = build_kv(config, parts.args, parts.model, None, parts.device, parts.dtype, 256)
    assert isinstance(kv, WriteScopeKV) and kv.policy == "writescope"
    kv.close()
    config.vram_budget_gb = 0.3  # less than the weights: refused before any KV is placed, naming the weights
    with pytest.raises(OutOfMemoryError, match="weights kept on the GPU need .* more than the VRAM budget"):
        build_kv(config, parts.args, parts.model, None, parts.device, parts.dtype, 256)
