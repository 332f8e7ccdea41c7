"""A quantised expert store's slots on a GPU: a fill copies the expert's blocks into a slot as they are
(the slot then holds the file's bytes, not 3.5× them in BF16); an offloaded layer over those slots and
the CPU share matches the float experts, at decode sizes (the blocks read in place:
engine/kernels/quant_moe_gpu.py) and at prefill sizes (GEMMs over the blocks:
engine/kernels/quant_moe_gemm_gpu.py, and the torch path where they cannot run). Needs no llama.cpp (random blocks), so it runs on the GPU machine (`-m cuda`); the CPU rows run
the same checks on the simulated hybrid path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_block_types import random_blocks

from engine.experts.cache import ExpertCache
from engine.experts.offload import OffloadedExperts
from engine.experts.store import ExpertStore
from engine.kernels import quant_moe_gemm_gpu
from engine.quant.blocks import QuantRows, QuantStack, QuantTensor, dequantize_blocks_torch

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# the same checks on the CPU (the simulated hybrid path: no copy stream, native dequantisation) check
# the tests themselves where no GPU is
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=CUDA)]

H = I = 256  # whole K-quant super-blocks
E = 20  # experts a layer
LAYER_TYPES = [(T.Q4_K, T.Q5_K, T.Q6_K), (T.Q6_K, T.Q6_K, T.Q5_1)]  # the second layer's blocks are longer


def stack(qtype, rows: int, cols: int, seed: int) -> QuantStack:
    data = random_blocks(E * rows, cols, qtype, seed=seed)
    whole = QuantTensor.from_gguf(data, int(qtype), "w")
    return QuantStack([whole[e * rows:(e + 1) * rows] for e in range(E)])


def layers():
    gate_up, down = [], []
    for l, (g, u, d) in enumerate(LAYER_TYPES):
        gs, us = stack(g, I, H, 10 * l), stack(u, I, H, 10 * l + 1)
        gate_up.append(QuantStack([QuantRows([a, b]) for a, b in zip(gs.experts, us.experts)]))
        down.append(stack(d, H, I, 10 * l + 2))
    return gate_up, down


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4])
def test_torch_dequantisation_on_the_gpu_is_the_cpus(qtype):
    if qtype in (T.Q4_0, T.Q4_1, T.Q8_0, T.MXFP4):
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, (64, 512 // 32 * {2: 18, 3: 20, 8: 34, 39: 17}[int(qtype)]), dtype=np.uint8)
        lead = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q8_0: [0]}.get(qtype, [])  # fp16 factors: finite, small
        blocks = data.reshape(64, 16, -1)
        for at in lead:
            blocks[:, :, at:at + 2] = (rng.uniform(-0.01, 0.01, (64, 16)).astype(np.float16)).view(np.uint8).reshape(
                64, 16, 2)
        if qtype == T.MXFP4:
            blocks[:, :, 0] = rng.integers(100, 140, (64, 16))  # scale exponents around 2^0
        data = blocks.reshape(64, -1)
    else:
        data = random_blocks(64, 512, qtype, seed=5)
    cpu = QuantTensor.from_gguf(data, int(qtype), "w").dequantize()
    gpu = dequantize_blocks_torch(torch.from_numpy(data).cuda(), int(qtype)).cpu()
    assert torch.equal(gpu, cpu)


@pytest.mark.parametrize("device", DEVICES)
def test_fills_copy_the_blocks_into_the_slots(device):
    gate_up, down = layers()
    store = ExpertStore.from_quant_layers(gate_up, down, dtype=torch.bfloat16, pin=device == "cuda")
    try:
        assert store.pinned == (device == "cuda") and len({layout.nbytes for layout in store.layouts.values()}) == 2
        cache = ExpertCache(2 * E, H, I, torch.bfloat16, torch.device(device), block_bytes=store.block_bytes)
        assert cache.pool.dtype == torch.uint8 and cache.slot_bytes == store.slot_bytes == store.block_bytes
        assert store.block_bytes < 3 * H * I  # a slot costs the blocks' bytes, under one byte a weight here
        for layer in (0, 1):  # the longest layer's slot length serves the shorter one too
            slots = list(range(layer * E, (layer + 1) * E))[::-1]
            cache.copy_in_many(slots, [store.block(layer, e) for e in range(E)])
        cache.synchronize()
        for layer in (0, 1):
            slots = list(range(layer * E, (layer + 1) * E))[::-1]
            assert torch.equal(cache.pool[slots].cpu(), torch.stack([store.block(layer, e) for e in range(E)]))
        assert cache.allocations == 1
    finally:
        store.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy,kernels", [("on-demand", True), ("on-demand", False), ("cpu-only", True)])
def test_an_offloaded_layer_over_quantised_blocks(policy, kernels, device, monkeypatch):
    """kernels: the prefill's GEMMs over the slots' blocks run (else the torch path that stands in where
    Triton cannot run them)."""
    if not kernels:
        monkeypatch.setattr(quant_moe_gemm_gpu, "available", lambda x: False)
    gate_up, down = layers()
    floats = [(g.dequantize(), d.dequantize()) for g, d in zip(gate_up, down)]  # (E, 2I, H), (E, H, I) fp32
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    store = ExpertStore.from_quant_layers(gate_up, down, dtype=dtype, pin=device == "cuda")
    experts = OffloadedExperts(policy, store, device=torch.device(device), n_slots=6, max_decode_tokens=4)
    try:
        gen = torch.Generator().manual_seed(0)
        for layer in (0, 1):
            for n in (1, 3, 40):  # decode sizes (CPU share), and prefill (fills)
                x = torch.randn(n, H, generator=gen) * 0.5
                ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(n)])  # (n, 2)
                w = torch.softmax(torch.randn(n, 2, generator=gen), -1)
                got = experts.run(layer, x.to(device, dtype), ids.to(device), w.to(device, dtype)).float().cpu()
                gu, dn = floats[layer]
                want = torch.zeros(n, H)
                for t in range(n):
                    for j in range(2):
                        e = int(ids[t, j])
                        h = gu[e] @ x[t]
                        want[t] += w[t, j] * (dn[e] @ (torch.nn.functional.silu(h[:I]) * h[I:]))
                # bf16 activations and slots, int16-rounded activations on the CPU: 2% of the scale
                assert (got - want).abs().max() <= 0.02 * want.abs().max() + 1e-3
        stats = experts.telemetry()
        if device == "cpu":  # every policy's one graph takes blocks too, on a GPU
            assert stats["zero_copy"] == {"off": "needs CUDA and Triton"}
        assert (stats["fills"] > 0) == (policy == "on-demand") and stats["cpu_executed"] > 0
        if policy == "on-demand":
            assert stats["cache_bytes"] == 6 * store.block_bytes  # the slots hold blocks
    finally:
        experts.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("biased", [False, True], ids=["swiglu", "gpt-oss form"])
def test_graph_pieces_split_a_layer_over_quantised_slots(device, biased):
    """What a decode graph piece runs (`run(..., cpu_buf=)`, the captured `gpu_side` in `between`): the
    slots' part by the quantised decode kernels (interpreted here without CUDA) plus the CPU set's sum
    equals the experts dequantised; with gpt-oss's form, each pair's biases come from its expert."""
    pytest.importorskip("triton")
    from engine.kernels import dequant_gpu
    from engine.kernels.experts_torch import ClampedSwiGLU

    if device == "cpu" and not dequant_gpu.interpreted():
        pytest.skip("CPU tensors need Triton's interpreter")
    gate_up, down = layers()
    floats = [(g.dequantize(), d.dequantize()) for g, d in zip(gate_up, down)]  # (E, 2I, H), (E, H, I) fp32
    store = ExpertStore.from_quant_layers(gate_up, down, dtype=torch.float32, pin=device == "cuda")
    experts = OffloadedExperts("on-demand", store, device=torch.device(device), n_slots=6, max_decode_tokens=4)
    gen = torch.Generator().manual_seed(1)
    form = ClampedSwiGLU(torch.randn(E, 2 * I, generator=gen) * 0.1, torch.randn(E, H, generator=gen) * 0.1,
                         alpha=1.702, limit=0.5) if biased else None
    try:
        if form is not None:
            for layer in (0, 1):
                experts.set_form(layer, ClampedSwiGLU(form.gate_up_bias.to(device), form.down_bias.to(device),
                                                      form.alpha, form.limit))
        for step in range(3):
            for layer in (0, 1):
                x = torch.randn(3, H, generator=gen) * 0.5
                ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(3)])  # (3, 2)
                w = torch.softmax(torch.randn(3, 2, generator=gen), -1)
                xd, idsd, wd = x.to(device), ids.to(device), w.to(device)
                cpu_buf = torch.full((3, H), float("nan"), device=device)
                on_slots = []
                assert experts.run(layer, xd, idsd, wd, cpu_buf=cpu_buf,
                                   between=lambda: on_slots.append(experts.gpu_side(layer, xd, idsd, wd))) is None
                got = (on_slots[0] + cpu_buf).cpu()
                gu, dn = floats[layer]
                want = torch.zeros(3, H)
                for t in range(3):
                    for j in range(2):
                        e = int(ids[t, j])
                        if form is None:
                            h = gu[e] @ x[t]
                            want[t] += w[t, j] * (dn[e] @ (torch.nn.functional.silu(h[:I]) * h[I:]))
                        else:
                            want[t] += w[t, j] * form.ffn(x[t:t + 1], e, gu[e], dn[e])[0]
                # int16-rounded activations in the CPU set's products: 2% of the scale
                assert (got - want).abs().max() <= 0.02 * want.abs().max() + 1e-3, (step, layer)
        stats = experts.telemetry()
        assert stats["fills"] > 0  # the slots computed their pairs (filled this layer or hit)
    finally:
        experts.close()
