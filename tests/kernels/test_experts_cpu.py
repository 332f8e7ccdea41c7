"""SwiGLU expert FFN on the CPU (engine/kernels/experts_cpu.py) against a float64 reference, for every
native ISA of this CPU and the torch fallback. Inputs are fresh random tensors each run."""

import math

import numpy as np
import pytest
import torch

from engine.errors import KernelInputError
from engine.kernels import experts_cpu
from engine.kernels.experts_cpu import expert_ffn

# Relative error allowed (of the largest output): fp32 keeps fp32 throughout; with 16-bit weights
# the activations are rounded to the weights' dtype (as torch's path does) and the output to x's.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def reference(x, gate_up, down):
    gate, up = (x.double() @ gate_up.double().T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ down.double().T


def weights(H, I, dtype):
    gate_up = (torch.randn(2 * I, H) / math.sqrt(H)).to(dtype)
    down = (torch.randn(H, I) / math.sqrt(I)).to(dtype)
    return gate_up, down


def check(y, x_as_used, gate_up, down, dtype):
    ref = reference(x_as_used, gate_up, down)
    assert not torch.isnan(y).any()
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64_reference_for_1_to_256_tokens(kernel_mode, dtype, monkeypatch):
    monkeypatch.setattr(experts_cpu, "_native_max_tokens", 256)  # the native kernel for every count
    H, I = 128, 96
    gate_up, down = weights(H, I, dtype)
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 64, 256):
        x = torch.randn(n, H).to(dtype)
        out = torch.full((n, H), math.nan).to(dtype)  # poisoned: every element must be written
        y = expert_ffn(x, gate_up, down, out=out, threads=2)
        assert y is out and y.dtype == dtype
        check(y, x, gate_up, down, dtype)


@pytest.mark.parametrize("H, I", [(1088, 96), (96, 1088), (1088, 80)])
def test_long_rows_read_in_chunks(kernel_mode, H, I, monkeypatch):
    """Rows longer than one K chunk (activations kept in L1: 1024 bf16 or 512 fp32 elements for 8 tokens),
    with a short last chunk; (1088, 80) takes the fp32-activation path (I is not a multiple of 32). Thread
    counts that split the rows unevenly, and token counts for every tile width."""
    monkeypatch.setattr(experts_cpu, "_native_max_tokens", 256)
    gate_up, down = weights(H, I, torch.bfloat16)
    for n, threads in ((1, 3), (3, 1), (6, 2), (8, 3), (16, 2), (19, 1)):
        x = torch.randn(n, H).bfloat16()
        check(expert_ffn(x, gate_up, down, threads=threads), x, gate_up, down, torch.bfloat16)


@pytest.mark.parametrize("dtype, I", [(torch.bfloat16, 96), (torch.bfloat16, 80), (torch.float16, 96)])
def test_token_groups_at_tile_width_boundaries(kernel_mode, dtype, I, monkeypatch):
    """5…8 tokens run as two 4-token groups over each weight chunk (the second re-reads it from L1);
    above 8 the tile width is whichever of 4 and 8 pads less (12 → 4, 13 → 8, 20 → 4, 21 → 8), with a
    last pass of one group (9, 20). H = 1088: K chunks of 1024 and 64; I = 80 takes fp32 activations."""
    monkeypatch.setattr(experts_cpu, "_native_max_tokens", 256)
    H = 1088
    gate_up, down = weights(H, I, dtype)
    for n, threads in ((5, 2), (7, 3), (8, 1), (9, 2), (12, 3), (13, 2), (20, 1), (21, 3)):
        x = torch.randn(n, H).to(dtype)
        out = torch.full((n, H), math.nan).to(dtype)
        check(expert_ffn(x, gate_up, down, out=out, threads=threads), x, gate_up, down, dtype)


def test_fp32_activations_with_bf16_weights(kernel_mode):
    H, I = 64, 32
    gate_up, down = weights(H, I, torch.bfloat16)
    x = torch.randn(6, H)
    y = expert_ffn(x, gate_up, down)
    assert y.dtype == torch.float32
    check(y, x.bfloat16(), gate_up, down, torch.bfloat16)


def test_strided_weights_and_activations(kernel_mode):
    """Weights as row-strided views (rows padded) and as slices of a stacked (E, 2I, H) store."""
    H, I, E = 64, 48, 3
    store_gu = (torch.randn(E, 2 * I, H + 16) / 8).bfloat16()
    store_dn = (torch.randn(E, H, I + 16) / 8).bfloat16()
    x = torch.randn(5, H + 8).bfloat16()[:, 4:4 + H]  # row stride H + 8
    for e in range(E):
        gate_up, down = store_gu[e, :, :H], store_dn[e, :, :I]
        assert not gate_up.is_contiguous()
        check(expert_ffn(x, gate_up, down), x, gate_up, down, torch.bfloat16)


def test_token_count_choice(monkeypatch):
    """Above native_max_tokens the torch kernel runs (and implementation says so)."""
    if experts_cpu.implementation(1) == "torch":
        pytest.skip("the native extension is not built")
    monkeypatch.setattr(experts_cpu, "_native_max_tokens", 4)
    assert experts_cpu.implementation(4).startswith("native-") and experts_cpu.implementation(5) == "torch"
    gate_up, down = weights(64, 32, torch.float32)
    x = torch.randn(9, 64)
    check(expert_ffn(x, gate_up, down), x, gate_up, down, torch.float32)


def test_bad_inputs_raise_clear_errors():
    gate_up, down = weights(64, 32, torch.bfloat16)
    with pytest.raises(KernelInputError, match="do not fit"):
        expert_ffn(torch.randn(2, 32), gate_up, down)
    with pytest.raises(KernelInputError, match="gate_up is"):
        expert_ffn(torch.randn(2, 64), gate_up, down.float())
    with pytest.raises(KernelInputError, match="2-D"):
        expert_ffn(torch.randn(2, 64).double(), gate_up, down)
    with pytest.raises(KernelInputError, match="out must be"):
        expert_ffn(torch.randn(2, 64), gate_up, down, out=torch.empty(3, 64))


def test_implementation_names_the_kernel(kernel_mode):
    assert experts_cpu.implementation(1) == ("torch" if kernel_mode == "torch" else f"native-{kernel_mode}")


# -- moe_ffn: one layer's experts in one call -----------------------------------------------------

def moe_reference(x, experts, tokens, weights):
    """float64 Σ over pairs of weight · expert(x[token]) → (N, H)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for (gate_up, down), tok, w in zip(experts, tokens, weights):
        tok = torch.as_tensor(tok, dtype=torch.int64)
        if tok.numel():
            out.index_add_(0, tok, reference(x[tok], gate_up, down) * torch.as_tensor(w).double().unsqueeze(1))
    return out


def check_moe(y, x, experts, tokens, weights, dtype):
    ref = moe_reference(x, experts, tokens, weights)
    assert y.dtype == torch.float32 and y.shape == x.shape and not torch.isnan(y).any()
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL[dtype], f"relative error {err:.2e}"


def routing(N, counts, gen):
    """counts[j] distinct random tokens of range(N) per expert, and fp32 weights in (0, 1]."""
    tokens = [torch.randperm(N, generator=gen)[:n] for n in counts]
    return tokens, [torch.rand(n, generator=gen) + 1e-3 for n in counts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_ffn_matches_float64_reference(kernel_mode, dtype, monkeypatch):
    """1…20 tokens per expert, tokens shared by several experts, one token routed to none (its row
    must come back 0 in a NaN-poisoned out), and a single expert."""
    monkeypatch.setattr(experts_cpu, "_native_max_tokens", 256)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    H, I, N = 128, 96, 24
    x = torch.randn(N, H).to(dtype)
    for counts in ([3], list(range(1, 21)), [1, 8, 2, 5, 1]):
        experts = [weights(H, I, dtype) for _ in counts]
        tokens, w = routing(N - 1, counts, gen)  # token N − 1 is routed to none
        out = torch.full((N, H), math.nan)
        y = experts_cpu.moe_ffn(x, experts, tokens, w, out=out, threads=3)
        assert y is out and (y[N - 1] == 0).all()
        check_moe(y, x, experts, tokens, w, dtype)


def test_moe_ffn_without_experts_or_pairs_is_zero(kernel_mode):
    H, I = 64, 32
    x = torch.randn(3, H)
    out = torch.full((3, H), math.nan)
    assert (experts_cpu.moe_ffn(x, [], [], [], out=out) == 0).all()
    out.fill_(math.nan)
    empty = torch.empty(0, dtype=torch.int64)
    y = experts_cpu.moe_ffn(x, [weights(H, I, torch.float32)], [empty], [torch.empty(0)], out=out)
    assert y is out and (y == 0).all()
    assert experts_cpu.moe_ffn(torch.empty(0, H), [weights(H, I, torch.float32)], [empty], [[]]).shape == (0, H)


def test_moe_ffn_duplicate_and_strided_experts(kernel_mode):
    """The same expert twice (shared storage), views into a stacked, row-padded store, numpy inputs,
    fp32 activations with bf16 weights, and a row-strided x."""
    H, I, E, N = 64, 48, 3, 6
    store_gu = (torch.randn(E, 2 * I, H + 16) / 8).bfloat16()
    store_dn = (torch.randn(E, H, I + 16) / 8).bfloat16()
    experts = [(store_gu[e, :, :H], store_dn[e, :, :I]) for e in (0, 2, 0, 1)]
    x = torch.randn(N, H + 8)[:, 4:4 + H]
    tokens = [np.array([0, 5]), np.array([5, 1, 2]), np.array([5]), np.array([3, 4, 0, 1])]
    w = [np.random.rand(len(t)).astype(np.float32) for t in tokens]
    y = experts_cpu.moe_ffn(x, experts, tokens, w, threads=2)
    check_moe(y, x.bfloat16(), experts, tokens, w, torch.bfloat16)


def test_moe_ffn_prefill_sized_experts(kernel_mode, monkeypatch):
    """Hundreds of tokens per expert go through in several passes of the native call; with a low
    native_max_tokens the large experts run through torch and the small ones natively, summed."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    H, I, N = 64, 32, 600
    x = torch.randn(N, H).bfloat16()
    counts = [N, 7, 450, 1, N]
    experts = [weights(H, I, torch.bfloat16) for _ in counts]
    tokens, w = routing(N, counts, gen)
    for max_tokens in (1 << 20, 8):
        monkeypatch.setattr(experts_cpu, "_native_max_tokens", max_tokens)
        check_moe(experts_cpu.moe_ffn(x, experts, tokens, w, threads=2), x, experts, tokens, w, torch.bfloat16)


def test_moe_ffn_bad_inputs_raise_clear_errors():
    H, I = 64, 32
    x, expert = torch.randn(4, H), weights(H, I, torch.bfloat16)
    tok, w = [torch.tensor([0, 1])], [torch.rand(2)]
    with pytest.raises(KernelInputError, match="token lists"):
        experts_cpu.moe_ffn(x, [expert], tok * 2, w)
    with pytest.raises(KernelInputError, match="shapes do not fit"):
        experts_cpu.moe_ffn(x, [expert, weights(H, 2 * I, torch.bfloat16)], tok * 2, w * 2)
    with pytest.raises(KernelInputError, match="experts\\[1\\] is"):
        experts_cpu.moe_ffn(x, [expert, weights(H, I, torch.float32)], tok * 2, w * 2)
    with pytest.raises(KernelInputError, match="outside"):
        experts_cpu.moe_ffn(x, [expert], [torch.tensor([0, 4])], w)
    with pytest.raises(KernelInputError, match="2 tokens but 3 weights"):
        experts_cpu.moe_ffn(x, [expert], tok, [torch.rand(3)])
    with pytest.raises(KernelInputError, match="integer"):
        experts_cpu.moe_ffn(x, [expert], [torch.tensor([0.0, 1.0])], w)
    with pytest.raises(KernelInputError, match="out must be"):
        experts_cpu.moe_ffn(x, [expert], tok, w, out=torch.empty(4, H, dtype=torch.bfloat16))
    with pytest.raises(KernelInputError, match="2-D"):
        experts_cpu.moe_ffn(x.double(), [expert], tok, w)


@pytest.mark.parametrize("H, I", [(128, 96), (1088, 96), (96, 1088)])
def test_amx_tiles_at_every_token_count(amx_everywhere, H, I, monkeypatch):
    """Groups of ≤ 16 tokens as even as they come (17 → 2 × 9, 33 → 3 × 11), passes of two groups and a
    last pass of one, odd numbers of 16-row blocks per thread (stage 2 takes two blocks at a time), rows
    longer than the prefetch distance."""
    monkeypatch.setattr(experts_cpu, "_native_max_tokens", 256)
    gate_up, down = weights(H, I, torch.bfloat16)
    for n, threads in ((1, 2), (2, 3), (4, 1), (5, 2), (8, 3), (16, 2), (17, 3), (33, 2), (64, 3)):
        x = torch.randn(n, H).bfloat16()
        out = torch.full((n, H), math.nan).bfloat16()
        check(expert_ffn(x, gate_up, down, out=out, threads=threads), x, gate_up, down, torch.bfloat16)
    x = torch.randn(6, H)  # fp32 activations in and out
    check(expert_ffn(x, gate_up, down, threads=2), x.bfloat16(), gate_up, down, torch.bfloat16)


def test_amx_tiles_in_one_moe_call(amx_everywhere, monkeypatch):
    """One layer's experts on AMX tiles and (below the threshold) vector tiles in one call."""
    monkeypatch.setattr(experts_cpu, "_native_max_tokens", 256)
    amx_everywhere.set_amx_min_tokens(4)
    H, I, N = 128, 96, 24
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    experts = [weights(H, I, torch.bfloat16) for _ in range(5)]
    tokens, w = routing(N, [1, 3, 4, 17, 24], gen)
    x = torch.randn(N, H).bfloat16()
    check_moe(experts_cpu.moe_ffn(x, experts, tokens, w, threads=3), x, experts, tokens, w, torch.bfloat16)


def test_prepared_moe_checks_now_and_computes_later_on_another_thread(kernel_mode):
    """prepare_moe validates and builds the call on the calling thread; the returned function computes
    (here on a worker thread, as the offload executor runs it) and fills `out`."""
    from concurrent.futures import ThreadPoolExecutor

    H, I, N = 64, 32, 5
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    experts = [weights(H, I, torch.bfloat16) for _ in range(3)]
    tokens, w = routing(N, [2, 1, 4], gen)
    x = torch.randn(N, H).bfloat16()
    out = torch.full((N, H), math.nan)
    compute = experts_cpu.prepare_moe(x, experts, tokens, w, out=out, threads=2)
    assert torch.isnan(out).all()  # nothing computed yet
    with ThreadPoolExecutor(1) as pool:
        y = pool.submit(compute).result()
    assert y is out
    check_moe(y, x, experts, tokens, w, torch.bfloat16)
    with pytest.raises(KernelInputError, match="2 tokens but 3 weights"):
        experts_cpu.prepare_moe(x, experts[:1], [np.array([0, 1])], [np.ones(3, np.float32)])


def test_native_worker_runs_prepared_sets_and_refuses_misuse():
    """MoeWorker runs a prepared set on its own thread: the result equals moe_ffn's; a second submit
    before the first is collected, a wait without a submit, a set that is not one native call and a
    bad table are refused with clear errors, and the worker stays usable after each."""
    from engine.kernels import native

    if native.module() is None:
        pytest.skip("needs the native extension")
    worker = experts_cpu.MoeWorker.create()
    H, I, N = 64, 32, 6
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    experts = [weights(H, I, torch.bfloat16) for _ in range(4)]
    tokens, w = routing(N, [2, 1, 6, 3], gen)
    x = torch.randn(N, H).bfloat16()
    for _ in range(3):  # the thread serves set after set
        out = torch.full((N, H), math.nan)
        prepared = experts_cpu.prepare_moe(x, experts, tokens, w, out=out, threads=2)
        assert prepared.one_native_call
        worker.submit(prepared)
        with pytest.raises(RuntimeError, match="not been collected"):
            worker.submit(prepared)
        y, queue_s, compute_s = worker.wait()
        assert y is out and queue_s >= 0 and compute_s > 0
        check_moe(y, x, experts, tokens, w, torch.bfloat16)
    with pytest.raises(RuntimeError, match="no CPU set was submitted"):
        worker.wait()
    torch_only = experts_cpu.prepare_moe(x.float(), [weights(H, I - 8, torch.float32)], tokens[:1], w[:1])
    assert not torch_only.one_native_call  # I = 24: not a multiple of 16, so the torch kernel
    with pytest.raises(ValueError, match="one native call"):
        worker.submit(torch_only)
    bad = experts_cpu.prepare_moe(x, experts, tokens, w, out=torch.empty(N, H), threads=2)
    bad.native_args[7][0, 4] += 1  # one pair more than tokens holds
    with pytest.raises(ValueError, match="pair counts must add up"):
        worker.submit(bad)
    worker.submit(experts_cpu.prepare_moe(x, experts, tokens, w, out=torch.empty(N, H), threads=2))
    worker.close()  # collects the set still running before the thread goes
