"""gpt-oss's expert form on the CPU kernels (engine/kernels/experts_cpu.py with a ClampedSwiGLU form):
biases on gate, up and down, and the clamped SwiGLU (g ≤ limit, |u| ≤ limit, (u + 1)·g·σ(alpha·g)),
against an fp32 torch reference, for every native ISA of this CPU (AMX tiles included) and the torch
fallback. Weights are scaled so that the clamps bind for part of the elements (asserted)."""

import math

import numpy as np
import pytest
import torch

from engine.errors import KernelInputError
from engine.experts.cpu_set import CpuSetRunner, form_cpu_set
from engine.kernels import experts_cpu, native
from engine.kernels.experts_torch import ClampedSwiGLU

# Relative error allowed (of the largest output), as test_experts_cpu's: fp32 stays fp32; with bf16
# weights x and h are rounded to bf16 (h of up to (limit + 1)·limit = 56 keeps 8 bits).
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
ALPHA, LIMIT = 1.702, 7.0
E = 6  # experts of the layer the biases belong to


def make_form(H, I, bias_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ClampedSwiGLU((torch.randn(E, 2 * I, generator=g) * 2).to(bias_dtype),
                         (torch.randn(E, H, generator=g) * 2).to(bias_dtype), ALPHA, LIMIT)


def make_expert(H, I, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # std 4 pre-activations for unit x: |g|, |u| > 7 for ~8% of the elements
    gate_up = (torch.randn(2 * I, H, generator=g) * 4 / math.sqrt(H)).to(dtype)
    down = (torch.randn(H, I, generator=g) / math.sqrt(I)).to(dtype)
    return gate_up, down


def reference(x, gate_up, down, form, e):
    """fp32 torch: the form's own ffn on fp32 copies of the operands as the kernel reads them."""
    f32 = ClampedSwiGLU(form.gate_up_bias.float(), form.down_bias.float(), form.alpha, form.limit)
    return f32.ffn(x.float(), e, gate_up.float(), down.float())


def clamp_share(x, gate_up, form, e):
    """Shares of (gate above limit, up above limit, up below −limit) among the pre-activations."""
    I = gate_up.shape[0] // 2
    g, u = (x.float() @ gate_up.float().T + form.gate_up_bias[e].float()).split(I, dim=-1)
    return (g > LIMIT).float().mean().item(), (u > LIMIT).float().mean().item(), (u < -LIMIT).float().mean().item()


def check(y, ref, dtype):
    assert not torch.isnan(y).any()
    err = (y.double() - ref.double()).abs().max().item() / ref.abs().max().item()
    assert err < TOL[dtype], f"relative error {err:.2e}"


FORMS = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)]


@pytest.mark.parametrize("dtype, bias_dtype", FORMS)
def test_one_expert_matches_fp32_reference_for_1_to_16_tokens(kernel_mode, dtype, bias_dtype):
    """H = 128, I = 96 (bf16 activations on avx512bf16 / amx); I = 80 takes fp32 activations."""
    if kernel_mode == "torch" and bias_dtype != dtype:
        pytest.skip("torch's linear takes biases of the weights' dtype")
    for H, I in ((128, 96), (128, 80)):
        gate_up, down = make_expert(H, I, dtype, seed=1)
        form = make_form(H, I, bias_dtype)
        clamped = np.zeros(3)
        for n in range(1, 17):
            x = torch.randn(n, H).to(dtype)
            out = torch.full((n, H), math.nan).to(dtype)  # poisoned: every element must be written
            e = n % E
            y = experts_cpu.expert_ffn(x, gate_up, down, out=out, threads=2, form=form, expert=e)
            assert y is out
            check(y, reference(x, gate_up, down, form, e), dtype)
            clamped += clamp_share(x, gate_up, form, e)
        assert (clamped > 0).all(), "every clamp must bind for some elements"
        assert (clamped / 16 < 0.5).all(), "and most elements pass through unclamped"


@pytest.mark.parametrize("H, I", [(128, 96), (1088, 64)])
def test_amx_tiles_take_the_form(amx_everywhere, H, I, monkeypatch):
    """The AMX tiles for 1…16 tokens (1088: K longer than one 1024-element pass of a tile)."""
    gate_up, down = make_expert(H, I, torch.bfloat16, seed=2)
    form = make_form(H, I, torch.bfloat16, seed=3)
    for n in (1, 3, 9, 16):
        x = torch.randn(n, H).bfloat16()
        y = experts_cpu.expert_ffn(x, gate_up, down, threads=3, form=form, expert=4)
        check(y, reference(x, gate_up, down, form, 4), torch.bfloat16)


def moe_inputs(H, I, dtype, counts, seed=5):
    """Experts with `counts` pairs each over N = max(counts) tokens (no token twice per expert)."""
    N = max(counts)
    experts = [make_expert(H, I, dtype, seed + j) for j in range(len(counts))]
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randperm(N, generator=g)[:c].numpy().astype(np.int64) for c in counts]
    weights = [torch.rand(c, generator=g).numpy().astype(np.float32) for c in counts]
    return torch.randn(N, H).to(dtype), experts, tokens, weights


def moe_reference(x, experts, tokens, weights, form, ids):
    out = torch.zeros(x.shape)
    for (gate_up, down), tok, w, e in zip(experts, tokens, weights, ids):
        idx = torch.from_numpy(tok)
        out.index_add_(0, idx, reference(x[idx], gate_up, down, form, e) * torch.from_numpy(w)[:, None])
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_call_adds_each_experts_own_biases(kernel_mode, dtype):
    """One call over experts of 1, 4, 16, 9 and 6 tokens, named out of order (5, 0, 3, 2, 1): each
    must add its own row of the biases."""
    H, I = 128, 96
    x, experts, tokens, weights = moe_inputs(H, I, dtype, [1, 4, 16, 9, 6])
    form, ids = make_form(H, I, dtype, seed=6), [5, 0, 3, 2, 1]
    out = torch.full((x.shape[0], H), math.nan)
    y = experts_cpu.moe_ffn(x, experts, tokens, weights, out=out, threads=3, form=form, expert_ids=ids)
    check(y, moe_reference(x, experts, tokens, weights, form, ids), dtype)
    plain = experts_cpu.moe_ffn(x, experts, tokens, weights, threads=3)  # guard: the form changes the result
    assert (plain - y).abs().max() > 0.1 * y.abs().max()


def test_cpu_set_of_a_form_runs_on_the_native_worker():
    """The CPU set of gpt-oss experts (form_cpu_set, as the offloaded policies prepare it) is one native
    call, which CpuSetRunner hands to the native worker thread; its result equals the reference."""
    if native.module() is None:
        pytest.skip("needs the native extension")
    H, I = 128, 96
    x, experts, tokens, weights = moe_inputs(H, I, torch.bfloat16, [2, 1, 4])
    form, ids = make_form(H, I, torch.bfloat16, seed=7), [3, 1, 4]
    prepared = form_cpu_set(form, x, ids, experts, tokens, weights, out=torch.empty(x.shape[0], H))
    assert prepared.one_native_call and prepared.native_args[-4] == 1  # act: the clamped SwiGLU
    runner = CpuSetRunner()
    try:
        runner.submit(prepared)
        out, _, compute_s = runner.result()
        assert runner.native and compute_s > 0
    finally:
        runner.close()
    check(out, moe_reference(x, experts, tokens, weights, form, ids), torch.bfloat16)


def test_more_tokens_than_the_native_kernel_takes_go_through_the_forms_torch_path(monkeypatch):
    monkeypatch.setattr(experts_cpu, "_native_max_tokens", 4)
    H, I = 64, 32
    x, experts, tokens, weights = moe_inputs(H, I, torch.float32, [3, 8])
    form, ids = make_form(H, I, torch.float32, seed=8), [2, 5]
    prepared = experts_cpu.prepare_moe(x, experts, tokens, weights, form=form, expert_ids=ids)
    assert not prepared.one_native_call
    check(prepared(), moe_reference(x, experts, tokens, weights, form, ids), torch.float32)


def test_bad_forms_raise_clear_errors():
    H, I = 64, 32
    gate_up, down = make_expert(H, I, torch.float32, seed=9)
    x = torch.randn(2, H)
    form = make_form(H, I, torch.float32)
    with pytest.raises(KernelInputError, match="biases do not fit"):
        experts_cpu.expert_ffn(x, gate_up, down, form=make_form(H, 2 * I, torch.float32))
    with pytest.raises(KernelInputError, match="one fp32/bf16/fp16 dtype"):
        experts_cpu.expert_ffn(x, gate_up, down, form=ClampedSwiGLU(form.gate_up_bias, form.down_bias.bfloat16()))
    with pytest.raises(KernelInputError, match="outside the form's 6 experts"):
        experts_cpu.expert_ffn(x, gate_up, down, form=form, expert=6)
    with pytest.raises(KernelInputError, match="expert_ids"):
        experts_cpu.moe_ffn(x, [(gate_up, down)], [np.array([0])], [np.array([1.0], np.float32)], form=form)
    with pytest.raises(KernelInputError, match="ClampedSwiGLU"):
        experts_cpu.expert_ffn(x, gate_up, down, form="gpt-oss")
    nat = native.module()
    if nat is not None:  # the binding refuses an unknown activation
        y = torch.empty_like(x)
        with pytest.raises(ValueError, match="act must be"):
            nat.expert_ffn(x.data_ptr(), 0, 2, H, I, H, gate_up.data_ptr(), down.data_ptr(), 0, H, I, y.data_ptr(), 0,
                           H, 1, act=2)
