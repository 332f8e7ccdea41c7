"""Routed experts resident on the GPU in their GGUF blocks (engine/experts/gpu_quant_resident.py):
decode sizes through the matrix-vector kernels over the blocks in place, prefill sizes through the
GEMM kernels over them, both against the dequantised experts in fp32. The
device pool holds the file's bytes. Triton's interpreter runs the kernels on CPU tensors here
(tests/conftest.py); `-m cuda` compiles them on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_block_types import random_blocks

pytest.importorskip("triton")

from engine.experts.executor import ResidentExperts  # noqa: E402
from engine.experts.gpu_quant_resident import GpuQuantResidentExperts  # noqa: E402
from engine.kernels import dequant_gpu, quant_moe_gemm_gpu  # noqa: E402
from engine.kernels.experts_torch import moe_experts  # noqa: E402
from engine.quant.blocks import QuantRows, QuantStack, QuantTensor  # noqa: E402

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=CUDA)]
H = I = 256  # whole K-quant super-blocks
E = 6
LAYER_TYPES = [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q5_0, T.Q5_1, T.Q5_K)]  # the second layer's blocks are longer


def stack(qtype, rows: int, cols: int, seed: int, shared: bool = False) -> QuantStack:
    whole = QuantTensor.from_gguf(random_blocks(E * rows, cols, qtype, seed), int(qtype), "w")
    experts = [whole[e * rows:(e + 1) * rows] for e in range(E)]
    return QuantStack([experts[0]] * E if shared else experts)


def layers(shared_last: bool = False):
    """Per layer gate_up (QuantRows of gate and up) and down stacks; shared_last: the last layer's
    experts are one expert listed E times (the upcycled built-in's kind)."""
    gate_up, down = [], []
    for l, (g, u, d) in enumerate(LAYER_TYPES):
        shared = shared_last and l == len(LAYER_TYPES) - 1
        gs, us = stack(g, I, H, 10 * l, shared), stack(u, I, H, 10 * l + 1, shared)
        rows = [QuantRows([a, b]) for a, b in zip(gs.experts, us.experts)]
        gate_up.append(QuantStack([rows[0]] * E if shared else rows))
        down.append(stack(d, H, I, 10 * l + 2, shared))
    return gate_up, down


def on(device: str) -> torch.device:
    if device == "cpu" and not dequant_gpu.interpreted():
        pytest.skip("CPU tensors need Triton's interpreter (set where there is no CUDA)")
    return torch.device(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared_last", [False, True])
def test_decode_and_prefill_follow_the_dequantised_experts(device, shared_last):
    device = on(device)
    gate_up, down = layers(shared_last)
    ex = GpuQuantResidentExperts(gate_up, down, device, torch.float32)
    distinct = len(LAYER_TYPES) * E - (E - 1 if shared_last else 0)
    assert ex.pool.shape[0] == distinct and ex.pool.dtype == torch.uint8 and ex.pool.device.type == device.type
    assert ex.nbytes() == ex.pool.numel() < 3 * H * I * distinct  # under a byte a weight: blocks, not floats
    assert ex.capture_problem(device, 8) is None
    g = torch.Generator().manual_seed(0)
    for layer in range(len(LAYER_TYPES)):
        gu, dn = gate_up[layer].dequantize(), down[layer].dequantize()  # (E, 2I, H), (E, H, I) fp32
        for n in (1, 3, 24):  # decode sizes in place; prefill by the GEMM kernels
            x = torch.randn(n, H, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(n)])  # (n, 3)
            w = torch.softmax(torch.randn(n, 3, generator=g), -1)
            got = ex.run(layer, x.to(device), ids.to(device), w.to(device)).cpu()
            want = moe_experts(x, ids, w, gu, dn)
            # fp32 throughout: only the order of the sums differs
            assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (layer, n)
    assert ex.tokens_routed == len(LAYER_TYPES) * 3 * (1 + 3 + 24)


@pytest.mark.parametrize("device", DEVICES)
def test_gpt_oss_form_runs_over_the_blocks(device, monkeypatch):
    """Biases by expert id and the clamped SwiGLU, at decode sizes in place and prefill sizes by the GEMM
    kernels, and by the torch path that stands in where they cannot run."""
    from engine.kernels.experts_torch import ClampedSwiGLU

    device = on(device)
    gate_up, down = layers()
    ex = GpuQuantResidentExperts(gate_up, down, device, torch.float32)
    g = torch.Generator().manual_seed(4)
    form = ClampedSwiGLU(torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g), alpha=1.702, limit=0.5)
    ex.set_form(1, ClampedSwiGLU(form.gate_up_bias.to(device), form.down_bias.to(device), form.alpha, form.limit))
    gu, dn = gate_up[1].dequantize(), down[1].dequantize()
    for n in (2, 20):
        x = torch.randn(n, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(n)])
        w = torch.softmax(torch.randn(n, 3, generator=g), -1)
        got = ex.run(1, x.to(device), ids.to(device), w.to(device)).cpu()
        want = moe_experts(x, ids, w, gu, dn, form)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), n
    monkeypatch.setattr(quant_moe_gemm_gpu, "available", lambda x: False)
    got = ex.run(1, x.to(device), ids.to(device), w.to(device)).cpu()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_experts_in_blocks_stay_blocks_and_tensors_are_placed():
    """Placement decides (models/assemble.place_tensor) and resident_experts follows what it is given: a
    GGUF's stacks stay blocks on the GPU (the GPU executor, plain or gpt-oss's form, set later) and on the
    CPU (the CPU executor); a family whose experts load as tensors goes to the device as tensors."""
    from engine.models.assemble import place_tensor
    from engine.quant.experts import QuantResidentExperts, resident_experts

    gate_up, down = layers()
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        kept = [place_tensor(t, cuda, torch.bfloat16) for t in gate_up], [place_tensor(t, cuda, torch.bfloat16)
                                                                          for t in down]
        assert kept[0][0] is gate_up[0]  # as read: the executor lays the blocks out on the device itself
        assert isinstance(resident_experts(*kept, cuda, torch.bfloat16), GpuQuantResidentExperts)
    assert isinstance(resident_experts(gate_up, down), QuantResidentExperts)
    cpu = torch.device("cpu")
    floats = [g.dequantize() for g in gate_up], [d.dequantize() for d in down]
    placed = resident_experts(*([place_tensor(t, cpu, torch.bfloat16) for t in ts] for ts in floats))
    assert type(placed) is ResidentExperts and placed.gate_up[0].dtype == torch.bfloat16


def test_larger_decode_batches_are_not_captured_and_misshapen_forms_are_refused():
    from engine.kernels.experts_torch import ClampedSwiGLU

    if not dequant_gpu.interpreted():
        pytest.skip("CPU tensors need Triton's interpreter")
    ex = GpuQuantResidentExperts(*layers(), torch.device("cpu"), torch.float32)
    assert "not yet captured" in ex.capture_problem(torch.device("cpu"), 16)
    with pytest.raises(ValueError, match="do not fit"):
        ex.set_form(0, ClampedSwiGLU(torch.zeros(E, I), torch.zeros(E, H)))


def test_gemm_kernels_that_fail_give_way_to_the_torch_path_for_good(monkeypatch, caplog):
    """A GEMM kernel that does not build on the machine (a Triton or driver version) must not stop the
    reply: that prefill and every later one run dequantised by torch ops, and the log says so once."""
    import logging

    from engine.experts import grouped_pairs

    if not dequant_gpu.interpreted():
        pytest.skip("CPU tensors need Triton's interpreter")
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("PTX JIT compilation failed\nmore")

    monkeypatch.setattr(quant_moe_gemm_gpu, "moe_prefill_quant", broken)
    monkeypatch.setattr(grouped_pairs, "_gemm_failed", None)
    gate_up, down = layers()
    ex = GpuQuantResidentExperts(gate_up, down, torch.device("cpu"), torch.float32)
    gu, dn = gate_up[0].dequantize(), down[0].dequantize()
    g = torch.Generator().manual_seed(2)
    with caplog.at_level(logging.WARNING, logger="tandem"):
        for _ in range(2):
            x = torch.randn(12, H, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(12)])
            w = torch.softmax(torch.randn(12, 3, generator=g), -1)
            want = moe_experts(x, ids, w, gu, dn)
            assert (ex.run(0, x, ids, w) - want).abs().max() <= 1e-4 * want.abs().max()
    assert len(calls) == 1 and grouped_pairs._gemm_failed == "RuntimeError: PTX JIT compilation failed"
    assert sum("failed (RuntimeError: PTX JIT compilation failed)" in r.getMessage() for r in caplog.records) == 1
