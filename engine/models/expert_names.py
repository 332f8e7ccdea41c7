"""Routed-expert tensor names of MoE checkpoints → the engine's fused per-layer layout.

The engine keeps each MoE layer's experts as two stacked tensors, the layout of transformers 5.x:

    model.layers.{i}.mlp.gate.weight               (E, H)      router
    model.layers.{i}.mlp.experts.gate_up_proj      (E, 2·I, H) gate rows first, then up
    model.layers.{i}.mlp.experts.down_proj         (E, H, I)

Checkpoints on disk spell them in one of three ways, all accepted (even mixed per layer):
  - fused, as above (transformers ≥ 5 can write these);
  - per expert, `mlp.experts.{e}.gate_proj / up_proj / down_proj.weight` (Qwen-MoE, OLMoE, and
    what transformers 5.x `save_pretrained` writes back);
  - Mixtral's `block_sparse_moe.experts.{e}.w1 / w3 / w2.weight` (gate / up / down) with the router
    at `block_sparse_moe.gate.weight`.
GGUF files store `blk.{i}.ffn_gate_exps / ffn_up_exps / ffn_down_exps` already stacked per layer.
"""

from __future__ import annotations

import re

import torch

from engine.errors import ModelFileError
from engine.models.hf_config import expert_count

_PER_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_MIXTRAL_ROUTER = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def fuse_experts(raw: dict[str, torch.Tensor], n_experts: int) -> dict[str, torch.Tensor]:
    """Rename and stack every per-expert tensor of `raw`; other tensors pass through unchanged.

    The per-expert tensors are dropped from the result as each layer is stacked, so memory-mapped
    shards can be released; the stacked copy is the only one kept. Errors name the layer; the
    loader puts the file's path in front.
    """
    out: dict[str, torch.Tensor] = {}
    per_layer: dict[int, dict[str, dict[int, torch.Tensor]]] = {}  # layer → role → expert → weight
    for name, t in raw.items():
        m = _PER_EXPERT.fullmatch(name)
        if m:
            layer, expert, role = int(m[1]), int(m[2]), _ROLE[m[3]]
            per_layer.setdefault(layer, {}).setdefault(role, {})[expert] = t
            continue
        m = _MIXTRAL_ROUTER.fullmatch(name)
        out[f"model.layers.{m[1]}.mlp.gate.weight" if m else name] = t

    for layer in sorted(per_layer):
        roles = per_layer.pop(layer)
        p = f"model.layers.{layer}.mlp.experts."
        if p + "gate_up_proj" in out or p + "down_proj" in out:
            raise ModelFileError(f"layer {layer} holds its experts both fused and one by one",
                                 "the checkpoint mixes two conversions: re-download or re-convert it")
        for role in ("gate", "up", "down"):
            have = roles.get(role, {})
            missing = [e for e in range(n_experts) if e not in have]
            extra = sorted(e for e in have if e >= n_experts)
            if missing or extra:
                what = f"missing {role} weights of experts {missing[:4]}" if missing else \
                    f"{role} weights of experts {extra[:4]} beyond the {n_experts} the config declares"
                raise ModelFileError(f"layer {layer} has {what}",
                                     "the checkpoint is incomplete or does not match its config.json")
        gate, up, down = roles["gate"], roles["up"], roles["down"]
        _same_shapes(layer, gate, up, down)
        I, H = gate[0].shape
        gate_up = torch.empty((n_experts, 2 * I, H), dtype=gate[0].dtype)  # (E, 2I, H)
        for e in range(n_experts):
            gate_up[e, :I].copy_(gate.pop(e))
            gate_up[e, I:].copy_(up.pop(e))
        out[p + "gate_up_proj"] = gate_up
        out[p + "down_proj"] = torch.stack([down.pop(e) for e in range(n_experts)])  # (E, H, I)
    return out


def _same_shapes(layer: int, gate: dict, up: dict, down: dict) -> None:
    I, H = gate[0].shape
    for role, weights, shape in (("gate", gate, (I, H)), ("up", up, (I, H)), ("down", down, (H, I))):
        for e, w in weights.items():
            if tuple(w.shape) != shape:
                raise ModelFileError(
                    f"layer {layer} expert {e} {role} weight has shape {tuple(w.shape)}, expected {shape}",
                    "the checkpoint is corrupt or mixes models: re-download it")


def fuse_gguf_experts(gate_exps: torch.Tensor, up_exps: torch.Tensor) -> torch.Tensor:
    """GGUF ffn_gate_exps, ffn_up_exps (E, I, H) each → gate_up (E, 2I, H), gate first. Experts kept
    in blocks (the loader's `QuantStack`s) are joined per expert without a copy."""
    from engine.quant.blocks import QuantStack

    if isinstance(gate_exps, QuantStack):
        return QuantStack.cat_rows(gate_exps, up_exps, name="gate_up_proj")
    return torch.cat([gate_exps, up_exps], dim=1)


def sanitize_moe_hf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A MoE folder's tensors under the engine's names: cached RoPE buffers dropped, experts fused."""
    raw = {k: v for k, v in raw.items() if "rotary_emb.inv_freq" not in k}
    return fuse_experts(raw, expert_count(config))
