"""Every routed expert resident on the CPU as quantised blocks: the executor for `QuantStack` layers.

Σ_k w_k · expert_k(x) with each expert a SwiGLU over gate_up (2I, H), gate rows first, and down (H, I).
gate_up is one `QuantTensor` (the built-in MoE's rows, joined once) or a `QuantRows` of gate and up
apart (a GGUF's `ffn_gate_exps` / `ffn_up_exps` rows viewed in the file, whose types may differ: then
two products, no copy of the experts). Experts that are one block tensor listed several times (the
upcycled built-in MoE: 8 copies of the dense FFN) are computed once per token, with the token's
weights of those copies summed: equal in value, one read of the blocks instead of top-k.

gpt-oss's experts (`set_form`: an experts_torch.ClampedSwiGLU, a GGUF's MXFP4 blocks) run the same
block products with the form's per-expert biases added to their fp32 outputs and its clamped
activation between them, expert by expert (the biases differ per expert, so copies are not merged):

    g = W_g x + b_g, u = W_u x + b_u      (n, I) each: two products over the gate and up rows
    y = W_d act(g, u) + b_d               (n, H): act = (clamp(u, ±limit) + 1) · g'·σ(alpha·g'), g' = min(g, limit)
"""

from __future__ import annotations

import numpy as np
import torch

from engine.experts.executor import ResidentExperts
from engine.experts.gpu_quant_resident import GpuQuantResidentExperts
from engine.kernels.experts_torch import ClampedSwiGLU, swiglu
from engine.quant.blocks import QuantStack
from engine.quant import moe as quant_moe
from engine.quant.matmul import expert_tiles, implementation, native_max_tokens, quant_linear


class QuantResidentExperts(ResidentExperts):
    policy = "resident"

    def __init__(self, gate_up: list[QuantStack], down: list[QuantStack]):
        super().__init__(gate_up, down)
        # per layer: expert → index of its distinct (gate_up, down) pair, and those pairs
        self.groups: list[torch.Tensor] = []
        self.unique: list[list[tuple]] = []
        for gu, dn in zip(gate_up, down):
            index: dict[tuple[int, int], int] = {}
            pairs = []
            of = []
            for g, d in zip(gu.experts, dn.experts):
                key = (id(g), id(d))
                if key not in index:
                    index[key] = len(pairs)
                    pairs.append((g, d))
                of.append(index[key])
            self.groups.append(torch.tensor(of, dtype=torch.long))  # (E,)
            self.unique.append(pairs)
        # per layer: the distinct experts' (G, 3) block addresses and the layer's types, for decode
        # steps as one native call (engine/quant/moe.py); None where the types vary within the layer
        self.tables: list[tuple[np.ndarray, tuple] | None] = []
        for pairs in self.unique:
            rows = [quant_moe.block_addresses(gu, dn) for gu, dn in pairs]
            same = len({types for *_, types in rows}) == 1
            self.tables.append((np.array([r[:3] for r in rows], dtype=np.int64), rows[0][3]) if same else None)

    def set_form(self, layer, form: ClampedSwiGLU) -> None:
        """The layer's experts have biases and the clamped SwiGLU (gpt-oss): the form's biases are
        (E, 2I) gate half first and (E, H), indexed by expert id (so its experts are not merged)."""
        E, two_i, H = self.gate_up[layer].shape
        if form.gate_up_bias.shape != (E, two_i) or form.down_bias.shape != (E, H):
            raise ValueError(f"layer {layer}: expert biases {tuple(form.gate_up_bias.shape)}, "
                             f"{tuple(form.down_bias.shape)} do not fit {E} experts of ({two_i}, {H})")
        if len(self.unique[layer]) != E:
            raise ValueError(f"layer {layer}: experts with biases of their own cannot share blocks")
        self.forms[layer] = form

    def run(self, layer, x, ids, weights):
        """x (N, H), ids (N, k), weights (N, k) → (N, H) in x's dtype."""
        self.tokens_routed += ids.numel()
        form = self.forms.get(layer)
        pairs = self.unique[layer]
        if len(pairs) == 1 and form is None:  # every expert the same blocks: one SwiGLU, each token weighted
            gate_up, down = pairs[0]  # by its k weights' sum; one dense FFN, so its tiles are a dense layer's
            return swiglu_blocks(x, gate_up, down, torch.float32) * weights.sum(-1, keepdim=True).to(x.dtype)
        group = self.groups[layer][ids]  # (N, k): distinct expert of each choice (the expert, with a form)
        out, heavy = None, torch.unique(group).tolist()  # heavy: the experts the loop below computes
        table = self.tables[layer]
        if table is not None:  # experts of few pairs (all of them in a decode step): one native call
            addresses, types = table
            g = group.numpy()
            chosen, counts, rows, w = quant_moe.group_pairs(g, weights, heavy, len(pairs))
            light = counts <= native_max_tokens(types)  # the kernel leads at so few pairs
            on = np.repeat(light, counts)  # (P,) the light experts' pairs
            prepared = quant_moe.prepare(x, np.concatenate([addresses[chosen[light]], counts[light, None]], axis=1),
                                         rows[on], np.ascontiguousarray(w[on]), types,
                                         self.gate_up[layer].shape[1] // 2, form=form, chosen=chosen[light])
            if prepared is not None:
                out, heavy = prepared(), chosen[~light].tolist()
        if out is None:
            out = torch.zeros(x.shape, dtype=torch.float32)
        for j in heavy:
            w = (weights.float() * (group == j)).sum(-1)  # (N,): the token's weight on expert j
            rows = torch.nonzero(w, as_tuple=True)[0]
            gate_up, down = pairs[j]
            y = swiglu_blocks(x[rows], gate_up, down) if form is None else \
                clamped_swiglu_blocks(x[rows], gate_up, down, form, j)
            out.index_add_(0, rows, y.float() * w[rows, None])
        return out.to(x.dtype)

    def block_types(self) -> list[str]:
        types: dict[str, None] = {}
        for stack in (*self.gate_up, *self.down):
            types.update(dict.fromkeys(stack.types()))
        return list(types)

    def nbytes(self) -> int:
        seen = {}
        for stack in (*self.gate_up, *self.down):
            for e in stack.experts:
                seen[id(e)] = e.nbytes
        return sum(seen.values())

    def telemetry(self) -> dict:
        types = self.block_types()
        kernel = f"{implementation(1)} over {'/'.join(types)} blocks" if types else None
        if kernel and self.forms:
            kernel += " (expert biases, clamped SwiGLU)"
        # they run on the CPU: the stats' (and the kernel panel's) CPU expert kernel
        return {"policy": self.policy, "bytes": self.nbytes(), "kernel": kernel, "cpu_kernel": kernel}


def swiglu_blocks(x: torch.Tensor, gate_up, down, tiles: torch.dtype | None = None) -> torch.Tensor:
    """x (n, H) → (n, H); gate_up a QuantTensor (2I, H) or a QuantRows of its gate and up (I, H) each;
    tiles: quant_linear's prefill tiles, routed experts' (expert_tiles) unless given."""
    tiles = tiles or expert_tiles()
    h = quant_linear(x, gate_up, tiles=tiles)  # (n, 2I): one call over gate and up, whatever their types
    return quant_linear(swiglu(h), down, tiles=tiles)  # (n, H)


def clamped_swiglu_blocks(x: torch.Tensor, gate_up, down, form: ClampedSwiGLU, e: int) -> torch.Tensor:
    """x (n, H) → (n, H) through expert e of a biased, clamped form; gate_up a QuantTensor (2I, H) or a
    QuantRows of gate and up (I, H) each, its bias added to the products before the activation."""
    bias, tiles = form.gate_up_bias[e], expert_tiles()  # (2I,) gate half first
    inter = bias.shape[0] // 2
    h = quant_linear(x, gate_up, bias, tiles)  # (n, 2I): one call over gate and up
    gate, up = h[..., :inter], h[..., inter:]
    return quant_linear(form.activation(gate, up), down, form.down_bias[e], tiles)


def resident_experts(gate_up: list, down: list, device: torch.device = torch.device("cpu"),
                     dtype: torch.dtype = torch.float32) -> ResidentExperts:
    """The resident executor for these placed experts: over blocks when they are quantised (on the CPU in
    place, on a GPU in one device pool: engine/experts/gpu_quant_resident.py), else over the tensors.
    dtype: the GPU's compute dtype."""
    if gate_up and isinstance(gate_up[0], QuantStack):
        if torch.device(device).type == "cpu":
            return QuantResidentExperts(gate_up, down)
        return GpuQuantResidentExperts(gate_up, down, device, dtype)
    return ResidentExperts(gate_up, down)
