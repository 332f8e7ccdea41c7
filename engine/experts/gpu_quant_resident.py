"""Every routed expert resident on the GPU as the file's quantised blocks.

A GGUF's experts stay in their blocks on the device (one (L·E, B) uint8 pool, an expert a row laid
out by its layer's `QuantLayout`: gate, up, down rows one after another), so a Q4_K_M model's experts
cost the file's bytes in VRAM, not 3.5× them in BF16, and a decode step reads those bytes only:

    a few tokens    the matrix-vector kernels over the rows in place (engine/kernels/quant_moe_gpu.py),
                    no host sync: a decode graph captures them
    more tokens     GEMM kernels that decode the blocks a tile at a time in registers and feed the
                    tensor cores (engine/kernels/quant_moe_gemm_gpu.py); no host sync

gpt-oss's experts (`set_form`: biases and the clamped SwiGLU) run both ways with the form's biases on
the device, looked up by expert id.
"""

from __future__ import annotations

import torch

from engine.experts.executor import ResidentExperts
from engine.experts.grouped_pairs import quant_pairs
from engine.experts.store import ExpertStore, QuantLayout
from engine.kernels import moe_decode_gpu, quant_moe_gpu
from engine.quant.blocks import QuantStack


class GpuQuantResidentExperts(ResidentExperts):
    policy = "resident"

    def __init__(self, gate_up: list[QuantStack], down: list[QuantStack], device: torch.device, dtype: torch.dtype):
        super().__init__([], [])  # the blocks are copied to the device: nothing keeps the file's views
        E, two_i, H = gate_up[0].shape
        self.n_experts, self.hidden, self.expert_ffn = E, H, two_i // 2
        # every layer's blocks as long as the longest layer's; experts listed twice (shared) take one row
        longest = max(QuantLayout.of_expert(gu.experts[0], dn.experts[0], H, two_i // 2).nbytes
                      for gu, dn in zip(gate_up, down))
        n_rows = sum(len({(id(g), id(d)) for g, d in zip(gu.experts, dn.experts)}) for gu, dn in zip(gate_up, down))
        self.pool = torch.zeros((n_rows, longest), dtype=torch.uint8, device=device)  # (L·E, B)
        self.layouts, self.rows = [], []  # per layer: its QuantLayout, (E,) int64 pool row of each expert
        self.offsets = []  # per layer: (E,) int64 byte offset of each expert's row, what the decode kernels read
        at = 0
        for gu, dn in zip(gate_up, down):  # a layer at a time through a host store of its blocks
            store = ExpertStore.from_quant_layers([gu], [dn], dtype=dtype)
            n = store.blocks.shape[0]
            self.pool[at:at + n, :store.block_bytes].copy_(store.blocks)
            self.rows.append(torch.from_numpy(store.block_of[0] + at).to(device))
            self.offsets.append(self.rows[-1] * self.pool.stride(0))
            self.layouts.append(store.layouts[0])
            at += n
            store.close()

    def set_form(self, layer: int, form) -> None:
        """The layer's experts add biases and take the clamped SwiGLU (gpt-oss): the form's biases (E, 2I)
        and (E, H) on the device, by expert id."""
        if form.gate_up_bias.shape != (self.n_experts, 2 * self.expert_ffn) or \
                form.down_bias.shape != (self.n_experts, self.hidden):
            raise ValueError(f"layer {layer}: expert biases {tuple(form.gate_up_bias.shape)}, "
                             f"{tuple(form.down_bias.shape)} do not fit {self.n_experts} experts of "
                             f"({2 * self.expert_ffn}, {self.hidden})")
        self.forms[layer] = form

    def run(self, layer, x, ids, weights):
        """x (N, H), ids (N, k), weights (N, k) → (N, H) in x's dtype."""
        self.tokens_routed += ids.numel()
        form = self.forms.get(layer)
        if x.shape[0] <= moe_decode_gpu.MAX_TOKENS:  # a few tokens: the rows read in place, no host sync
            # by expert id through the byte offsets: no kernel a layer to map ids to pool rows first
            return quant_moe_gpu.moe_decode_quant(x, ids, weights, self.pool, self.layouts[layer].kernel_parts,
                                                  self.expert_ffn, offsets=self.offsets[layer], form=form)
        return quant_pairs(x, ids, weights, self.pool, self.layouts[layer], self.rows[layer], form).to(x.dtype)

    def capture_problem(self, device: torch.device, max_batch: int) -> str | None:
        if max_batch > moe_decode_gpu.MAX_TOKENS:
            return (f"max_batch above {moe_decode_gpu.MAX_TOKENS} runs the GEMM kernels over the expert blocks, "
                    "not yet captured in a graph")
        return None

    def block_types(self) -> list[str]:
        return sorted({t for layout in self.layouts for t in layout.types})

    def nbytes(self) -> int:
        return self.pool.numel()

    def telemetry(self) -> dict:
        return {"policy": self.policy, "bytes": self.nbytes(),
                "kernel": f"{'/'.join(self.block_types())} blocks on the GPU: decode in place (quant_moe_gpu), "
                          "prefill by GEMM kernels over the blocks (quant_moe_gemm_gpu)"}

