"""Tiny random MoE models from transformers' own config classes, written as real folders, and the
comparisons every family's parity test makes against transformers' forward and generate."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.api import Engine, EngineConfig

PROMPT = [3, 17, 5, 42, 8, 9, 33, 61, 2, 70, 11, 4]
N_NEW = 20
# fp32 on the CPU: the same math in a different order (grouped experts, SDPA vs eager attention)
# differs by float rounding only; observed ≤ 1e-6, allowed 1e-4 absolute on O(1) logits.
FP32_ATOL = 1e-4


def build_hf(config_cls, model_cls, seed: int = 0, **overrides):
    """A randomly initialised transformers model of a tiny config (eager attention, fp32, eval)."""
    config = config_cls(**overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return model_cls(config).eval()


def write_layout(model, path: Path, layout: str) -> Path:
    """Write `model`'s weights with expert tensors named as `layout` says:
    fused      mlp.experts.gate_up_proj (E, 2I, H) / down_proj (E, H, I), router mlp.gate
    per_expert mlp.experts.{e}.gate_proj / up_proj / down_proj
    mixtral    block_sparse_moe.experts.{e}.w1 / w3 / w2, router block_sparse_moe.gate
    """
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj") and layout != "fused":
            prefix = name[: -len("mlp.experts.gate_up_proj")]
            inter = t.shape[1] // 2
            down = model.state_dict()[prefix + "mlp.experts.down_proj"]
            for e in range(t.shape[0]):
                if layout == "per_expert":
                    p = f"{prefix}mlp.experts.{e}."
                    out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = t[e, :inter], t[e, inter:]
                    out[p + "down_proj.weight"] = down[e]
                else:
                    p = f"{prefix}block_sparse_moe.experts.{e}."
                    out[p + "w1.weight"], out[p + "w3.weight"], out[p + "w2.weight"] = t[e, :inter], t[e, inter:], down[e]
        elif name.endswith("mlp.experts.down_proj") and layout != "fused":
            continue
        elif name.endswith("mlp.gate.weight") and layout == "mixtral":
            out[name.replace("mlp.gate", "block_sparse_moe.gate")] = t
        else:
            out[name] = t
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_dict()))
    return path


def tiny_engine(path, device: str = "cpu", dtype: str = "float32", **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), backend="tandem", device=device, dtype=dtype, max_batch=2, **kw))


@torch.inference_mode()
def engine_logits(engine: Engine, ids: list[int], prefill: int | None = None, forward: int | None = None) -> torch.Tensor:
    """Logits (T, V) of every position: `prefill` tokens in one step (all of them by default),
    then the rest one decode step at a time through the KV cache; or, given `forward`, every token
    read in forwards of that many."""
    p, kv = engine.parts, engine.parts.kv
    prefill = len(ids) if prefill is None else prefill
    sid = kv.new_sequence()
    rows = []
    try:
        if forward is not None:
            chunks = [ids[i:i + forward] for i in range(0, len(ids), forward)]
        else:
            chunks = [ids[:prefill]] + [[t] for t in ids[prefill:]]
        for chunk in chunks:
            positions = kv.begin_step([sid], len(chunk))
            rows.append(p.model(torch.tensor([chunk], device=p.device), positions, kv, last_only=False)[0])
            kv.end_step()
    finally:
        kv.free(sid)
    return torch.cat(rows).float().cpu()


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(torch.tensor([ids], device=device)).logits[0].float().cpu()


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int = N_NEW) -> list[int]:
    device = next(model.parameters()).device
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def assert_parity(engine: Engine, ref, prompt: list[int] = PROMPT) -> None:
    """fp32: logits of a prefill, and of decode steps through the KV cache, equal transformers'
    forward; greedy generation equals transformers' generate token for token."""
    theirs = hf_logits(ref, prompt)
    assert theirs.abs().max() > 0.5  # the model is not degenerate: logits really differ
    ours = engine_logits(engine, prompt)
    torch.testing.assert_close(ours, theirs, atol=FP32_ATOL, rtol=0)
    stepped = engine_logits(engine, prompt, prefill=3)  # 9 decode steps through the cache
    torch.testing.assert_close(stepped, theirs, atol=FP32_ATOL, rtol=0)
    expected = hf_greedy(ref, prompt)
    assert len(expected) == N_NEW
    assert engine.generate_ids(prompt, N_NEW) == expected
