"""A MoE layer's quantised experts in one native call (engine/quant/moe.py, native/quant_moe.h) against
the per-expert loop over the same blocks and against fp32 experts dequantised from them.

Tolerances: against the loop, the same products over the same blocks, so only SiLU's last bit and the
order of the weighted sum differ (the down product's int16 activations then round differently in rare
blocks): 1e-5 of the output scale. Against fp32 weights, the activations' int16 rounding per 32-block
(at most 2^-16 of the block's largest value per product, two products in sequence): 1e-3 of the scale;
4e-2 where AVX2's K-quant products read int8 activations per 256 values (helpers.quant_logit_tolerance).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from helpers import quant_logit_tolerance
from test_block_types import random_blocks

from engine.kernels import experts_cpu
from engine.quant import moe as quant_moe
from engine.quant.blocks import QuantRows, QuantStack, QuantTensor
from engine.quant.experts import QuantResidentExperts, swiglu_blocks
from engine.quant.matmul import native_max_tokens

pytestmark = pytest.mark.skipif(not quant_moe.available(), reason="the native extension is not built")

H, I, E, K = 256, 512, 6, 2


def stack(qtype, rows, cols, seed):
    whole = QuantTensor.from_gguf(random_blocks(E * rows, cols, qtype, seed=seed), int(qtype), "w")
    return QuantStack([whole[e * rows:(e + 1) * rows] for e in range(E)])


@pytest.fixture(scope="module")
def experts():
    gate, up, down = stack(T.Q4_K, I, H, 1), stack(T.Q5_K, I, H, 2), stack(T.Q6_K, H, I, 3)
    return QuantStack([QuantRows([g, u]) for g, u in zip(gate.experts, up.experts)]), down


def routing(n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])  # (n, K) distinct per token
    w = torch.softmax(torch.randn(n, K, generator=gen), -1)
    return x, ids, w


def loop(x, ids, w, gate_up, down):
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            out[t] += w[t, j] * swiglu_blocks(x[t:t + 1], gate_up.experts[e], down.experts[e])[0]
    return out


def native_set(x, ids, w, gate_up, down, experts_chosen=None):
    chosen_in = list(range(E)) if experts_chosen is None else experts_chosen
    chosen, counts, rows, pair_w = quant_moe.group_pairs(ids.numpy(), w, chosen_in, E)
    addresses = [quant_moe.block_addresses(gate_up.experts[e], down.experts[e]) for e in chosen]
    table = np.array([[*a[:3], c] for a, c in zip(addresses, counts)], dtype=np.int64)
    return quant_moe.prepare(x, table, rows, pair_w, addresses[0][3], I)


@pytest.mark.parametrize("n", [1, 3, 16])
def test_one_native_call_is_the_loop(experts, n):
    gate_up, down = experts
    x, ids, w = routing(n, seed=n)
    got = native_set(x, ids, w, gate_up, down)()
    want = loop(x, ids, w, gate_up, down)
    scale = float(want.abs().max())
    assert scale > 0 and float((got - want).abs().max()) <= 1e-5 * scale
    dense = torch.zeros(n, H)  # fp32 weights dequantised from the same blocks
    for t in range(n):
        for j in range(K):
            e = int(ids[t, j])
            h = gate_up.experts[e].dequantize() @ x[t]
            dense[t] += w[t, j] * (down.experts[e].dequantize() @ (torch.nn.functional.silu(h[:I]) * h[I:]))
    assert float((got - dense).abs().max()) <= quant_logit_tolerance() * float(dense.abs().max())


@pytest.mark.parametrize("threads", [3, 7, 64])
@pytest.mark.parametrize("n", [1, 5])
def test_any_team_size_splits_the_layer_rows_alike(experts, threads, n):
    """The set's threads split the gate/up rows, then the down rows, of all its experts laid end to
    end, and the output columns: every team size (one, uneven splits, more threads than the rows of
    an expert's share) gives the one-thread result, also with experts of the table without pairs."""
    from engine.kernels import native

    gate_up, down = experts
    x, ids, w = routing(n, seed=11)
    before = native.threads_setting()
    try:
        native.set_threads(1)
        want = native_set(x, ids, w, gate_up, down)()
        native.set_threads(threads)
        got = native_set(x, ids, w, gate_up, down)()
    finally:
        native.set_threads(before)
    assert n > 1 or ids.unique().numel() < E  # one token: the table's other experts have no pairs
    assert torch.equal(got, want)


def test_a_subset_of_experts_and_the_native_worker(experts):
    gate_up, down = experts
    x, ids, w = routing(4, seed=7)
    on_cpu = [1, 4]  # the CPU's share of the layer: the other experts' pairs are not its to add
    mask = torch.isin(ids, torch.tensor(on_cpu))
    want = loop(x, ids, w * mask, gate_up, down)
    here = native_set(x, ids, w, gate_up, down, on_cpu)()
    worker = experts_cpu.MoeWorker.create()
    try:
        prepared = native_set(x, ids, w, gate_up, down, on_cpu)
        worker.submit(prepared)
        there, _, _ = worker.wait()
    finally:
        worker.close()
    assert torch.equal(here, there)
    assert float((here - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_the_resident_executor_takes_it_for_experts_of_few_pairs(experts, monkeypatch):
    gate_up, down = experts
    executor = QuantResidentExperts([gate_up], [down])
    x, ids, w = routing(2, seed=3)
    calls = []
    monkeypatch.setattr(quant_moe.QuantMoe, "__call__",
                        lambda self, f=quant_moe.QuantMoe.__call__: calls.append(1) or f(self))
    got = executor.run(0, x, ids, w)
    assert calls and float((got - loop(x, ids, w, gate_up, down)).abs().max()) <= 1e-5 * float(got.abs().max())
    # a prefill chunk: the experts of at most native_max_tokens pairs take it too, the others run the loop
    # (dequantised tiles); 400 tokens over 6 experts give each more pairs than any kernel's lead
    limit = native_max_tokens(executor.tables[0][1])
    for n, native in ((400, False), (limit + 1, True)):
        x, ids, w = routing(n, seed=4)
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        assert bool((counts <= limit).any()) == native
        calls.clear()
        got = executor.run(0, x, ids, w)
        assert bool(calls) == native
        assert float((got - loop(x, ids, w, gate_up, down)).abs().max()) <= 2e-2 * float(got.abs().max())


def test_bad_tables_are_refused_before_any_output(experts):
    gate_up, down = experts
    x, ids, w = routing(2, seed=5)
    prepared = native_set(x, ids, w, gate_up, down)
    args = list(prepared._args)
    tokens = args[9].copy()
    tokens[0] = 99  # a token row past x
    args[9] = tokens
    with pytest.raises(ValueError, match="out of range"):
        from engine.kernels import native

        native.module().quant_moe(*args)


@pytest.mark.parametrize("n", [1, 5])
def test_gpt_oss_form_biases_and_clamp(experts, n, monkeypatch):
    """Biases per expert and the clamped SwiGLU (scaled so that many pre-activations pass the clamp)."""
    from engine.kernels.experts_torch import ClampedSwiGLU
    from engine.quant.experts import clamped_swiglu_blocks

    gate_up, down = experts
    gen = torch.Generator().manual_seed(11)
    form = ClampedSwiGLU(torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen), alpha=1.702, limit=0.5)
    x, ids, w = routing(n, seed=20 + n)
    x = x * 4  # pre-activations of a few units: past ±limit often
    want = torch.zeros(n, H)
    for t in range(n):
        for j in range(K):
            e = int(ids[t, j])
            want[t] += w[t, j] * clamped_swiglu_blocks(x[t:t + 1], gate_up.experts[e], down.experts[e], form, e)[0]
    executor = QuantResidentExperts([gate_up], [down])
    executor.set_form(0, form)
    calls = []
    monkeypatch.setattr(quant_moe.QuantMoe, "__call__",
                        lambda self, f=quant_moe.QuantMoe.__call__: calls.append(1) or f(self))
    got = executor.run(0, x, ids, w)
    assert calls  # one native call, biases and clamp inside it
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
