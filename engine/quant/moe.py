"""One MoE layer's quantised experts in one native call (native/quant_moe.h): `QuantMoe`.

The experts' gate, up and down products over their blocks, SiLU(gate)·up and the weighted sum, for
every (token, choice) pair the set holds, without Python between the products: the per-expert loop
(engine/quant/experts.py `swiglu_blocks`) spends ~60 µs of Python an expert around the same native
products. Experts of at most `native_max_tokens` pairs each (every expert of a decode step; a
prefill's too where the kernel leads that far, K-quants on AVX2); experts of more pairs run the
loop, whose products switch to dequantised tiles and a GEMM. gpt-oss's form (experts_torch.ClampedSwiGLU: fp32 biases
on the host, the clamped SwiGLU) is two more columns of the table and three arguments.

The table gives each expert's three block addresses (rows contiguous, a layer's types fixed):

    experts (J, 4) int64   gate address, up address, down address, pairs
                           (J, 6) with a form: + its gate_up and down bias rows' addresses
    tokens  (P,) int64     the token row of each pair, grouped by expert in table order
    weights (P,) float32   its routing weight
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import native
from engine.quant.blocks import QuantRows, QuantTensor
from engine.quant.matmul import native_max_tokens


def available() -> bool:
    nat = native.module()
    return nat is not None and hasattr(nat, "quant_moe")


def block_addresses(gate_up, down: QuantTensor) -> tuple[int, int, int, tuple[int, int, int]]:
    """An expert's (gate, up, down) addresses and their type codes; gate_up a QuantRows of gate and up
    (a GGUF's) or one QuantTensor of both (gate rows first)."""
    if isinstance(gate_up, QuantRows):
        gate, up = gate_up.parts
        return gate.blocks.data_ptr(), up.blocks.data_ptr(), down.blocks.data_ptr(), \
            (gate.qtype.code, up.qtype.code, down.qtype.code)
    half = gate_up.shape[0] // 2  # (2I, H): the up rows start I rows in
    start = gate_up.blocks.data_ptr()
    return start, start + half * gate_up.row_bytes, down.blocks.data_ptr(), \
        (gate_up.qtype.code, gate_up.qtype.code, down.qtype.code)


def group_pairs(ids: np.ndarray, weights: torch.Tensor, experts: list[int], n_experts: int):
    """The pairs of `experts` among the routing ids (N, k): (chosen (J,) ascending, pairs per chosen
    expert (J,), token rows (P,), weights (P,) fp32), pairs grouped by expert, in (token, choice) order
    (the order every native CPU set takes them in: engine/kernels/experts_cpu.py's tables too)."""
    k = ids.shape[1]
    flat = ids.ravel()  # (N·k,) expert of each (token, choice) pair
    chosen = np.array(sorted(experts), dtype=np.int64)
    on = np.zeros(n_experts, dtype=bool)
    on[chosen] = True
    pairs = np.flatnonzero(on[flat])
    pairs = pairs[np.argsort(flat[pairs], kind="stable")]
    counts = np.bincount(flat[pairs], minlength=n_experts)[chosen]
    w = np.ascontiguousarray(weights.reshape(-1).float().numpy()[pairs])
    return chosen, counts, np.ascontiguousarray(pairs // k), w


class QuantMoe:
    """A prepared set: calling it computes on the calling thread (the GIL released) and returns `out`
    (N, H) fp32; `start(worker)` hands it to the native worker instead (experts_cpu.MoeWorker)."""

    one_native_call = True

    def __init__(self, x: torch.Tensor, table: np.ndarray, tokens: np.ndarray, weights: np.ndarray,
                 types: tuple[int, int, int], inter: int, out: torch.Tensor, threads: int, form=None):
        N, H = x.shape
        self.out = out
        self._keep = (x, form)  # read through their addresses (x, the form's biases) until the set is done
        clamp = () if form is None else (True, float(form.alpha), float(form.limit))
        self._args = (x.data_ptr(), N, H, inter, x.stride(0), *types, table, tokens, weights, out.data_ptr(),
                      out.stride(0), threads, *clamp)

    def __call__(self) -> torch.Tensor:
        self.out.zero_()
        native.module().quant_moe(*self._args)
        return self.out

    def start(self, worker) -> None:
        self.out.zero_()
        worker.submit_quant(*self._args)


def prepare(x: torch.Tensor, table: np.ndarray, tokens: np.ndarray, weights: np.ndarray, types: tuple[int, int, int],
            inter: int, out: torch.Tensor | None = None, form=None, chosen: np.ndarray | None = None
            ) -> QuantMoe | None:
    """x (N, H) on the host, any float dtype; table (J, 4) int64 as the module docstring says; out
    (N, H) fp32 or None; form: a ClampedSwiGLU with the experts `chosen` (the table's rows) → a
    QuantMoe, or None where the native set does not take it (no extension, an expert of more pairs than
    `native_max_tokens`, biases that are not fp32 rows on the host)."""
    if not available() or not len(table):
        return None
    if int(table[:, 3].max()) > native_max_tokens(types):
        return None  # an expert of more pairs than the kernel leads at
    if form is not None:
        biases = [form.gate_up_bias, form.down_bias]  # (E, 2I), (E, H)
        if any(b.dtype != torch.float32 or b.device.type != "cpu" or b.stride(-1) != 1 for b in biases):
            return None
        rows = [b.data_ptr() + chosen.astype(np.int64) * b.stride(0) * 4 for b in biases]  # each chosen expert's row
        table = np.concatenate([table, np.stack(rows, axis=1)], axis=1)  # (J, 6)
    xf = x.float().contiguous()  # (N, H) fp32: a copy for any other dtype, read until the set is done
    out = torch.empty(xf.shape, dtype=torch.float32) if out is None else out
    return QuantMoe(xf, np.ascontiguousarray(table, dtype=np.int64), tokens, weights, types, inter, out,
                    native.threads(), form)
