"""A CPU decode step as one native call per decoder layer (engine/runtime/cpu_decode.py) against the
modules it stands in for. The call runs the same kernels in the same order, so the logits agree to fp32
rounding (SiLU's exp is libm's there, torch's vectorised one in the module); a step it does not take
runs the modules."""

from contextlib import closing

import numpy as np
import pytest
import torch
from test_quant_model import engine_for, write_quantised_llama

from engine.api import Engine, EngineConfig
from engine.kernels import native
from engine.runtime.cpu_decode import CPUDecodeSteps

NAT = native.module()
pytestmark = pytest.mark.skipif(NAT is None or not hasattr(NAT, "DecodeLayer"), reason="no native extension")
IDS = [3, 17, 5, 42, 8, 9, 33, 60, 2, 71, 11, 4]


def native_and_module_logits(engine, ids: list[int], prefill: int, neighbour: int = 0):
    """(T, V) logits of each decode step after `prefill` tokens, taken by the native layer calls and
    then, over the same past, by the modules (the step's KV row dropped in between). neighbour: tokens
    a second sequence prefills after the first one's, taking the KV blocks that follow its own."""
    parts, steps = engine.backend.parts, engine.backend.generator.graphs
    assert isinstance(steps, CPUDecodeSteps)
    kv, sid = parts.kv, parts.kv.new_sequence()
    by_native, by_modules = [], []
    try:
        with torch.inference_mode():
            for seq, chunk in [(sid, ids[:prefill])] + ([(kv.new_sequence(), ids[:neighbour])] if neighbour else []):
                positions = kv.begin_step([seq], len(chunk))
                parts.model(torch.tensor([chunk]), positions, kv)
                kv.end_step()
            for t in ids[prefill:]:
                past = kv.length(sid)
                positions = kv.begin_step([sid], 1)
                by_native.append(steps.step(torch.tensor([[t]]), positions)[0])
                kv.end_step()
                kv.crop(sid, past)
                positions = kv.begin_step([sid], 1)
                by_modules.append(parts.model(torch.tensor([[t]]), positions, kv)[0])
                kv.end_step()
    finally:
        kv.free(sid)
    return torch.stack(by_native), torch.stack(by_modules)


def test_a_llama_in_mixed_block_types_steps_natively_as_its_modules(tmp_path):
    # q, k and v of three types (Q4_0, Q4_1, Q8_0 in turn): the fused product's parts differ
    with closing(engine_for(write_quantised_llama(tmp_path / "q.gguf"))) as engine:
        native_rows, module_rows = native_and_module_logits(engine, IDS, prefill=5)
    # Where the ISA has the interleaved one-token kernel (AVX-512), the call's Q4_0/Q4_1 products read
    # 16-row copies: the same int32 block sums in another fp32 order, which this random model's layers
    # grow to ~4e-4 of its logits (|logit| ≤ 6), a tenth of either path's distance from the same
    # model dequantised to fp32 (4e-3: the activations' int16 rounding). Elsewhere they agree to 1e-6.
    torch.testing.assert_close(native_rows, module_rows, rtol=1e-3, atol=1e-3)
    assert native_rows.abs().max() > 0.1  # logits, not a buffer left at zero


def test_a_past_in_blocks_apart_is_read_as_runs(tmp_path):
    # blocks of 4 tokens: the first chat holds blocks 0–1, the second 2, so the first one's decode
    # continues in block 3 onwards and its past is two runs of slots
    config = EngineConfig(model=str(write_quantised_llama(tmp_path / "q.gguf")), backend="tandem", device="cpu",
                          max_batch=2, block_size=4)
    with closing(Engine(config)) as engine:
        native_rows, module_rows = native_and_module_logits(engine, IDS, prefill=5, neighbour=4)
        kv = engine.backend.parts.kv
        sid = kv.new_sequence()
        kv.seqs[sid].blocks, kv.seqs[sid].length = [0, 1, 3], 8  # as the first chat's were at its 9th token
        kv.begin_step([sid], 1)
        writes, runs, offsets = kv.decode_rows()
        kv.end_step()
    assert writes.tolist() == [12] and runs.tolist() == [[0, 8], [12, 1]] and offsets.tolist() == [0, 2]
    # the modules gather a past in blocks apart and attend with torch's SDPA, the native call reads the
    # runs with its own kernel: two summation orders of the softmax, so fp32 rounding apart, not 1e-4
    torch.testing.assert_close(native_rows, module_rows, rtol=1e-3, atol=1e-3)


def test_a_qwen3_moe_with_qk_norms_and_routed_experts(tmp_path):
    pytest.importorskip("llama_cpp")
    from helpers import INT8_ISAS, quant_logit_tolerance
    from test_quant_experts_gguf import write_quantised

    with closing(engine_for(write_quantised(tmp_path, "qwen3_moe", "Q4_K_M"))) as engine:
        assert engine.info()["cpu_decode"]["layers"] == 2
        assert engine.info()["cpu_decode"]["routed_layers"] == 2  # router and experts inside the layer's call
        experts = engine.backend.parts.model.model.layers[0].mlp.experts
        routed = experts.tokens_routed
        native_rows, module_rows = native_and_module_logits(engine, IDS, prefill=5)
        steps = len(IDS) - 5
        # the prompt's tokens by the modules, then each step's token in the native call and in the modules:
        # the executor (one for both layers) counts all of them
        top_k = engine.backend.parts.model.args.top_k
        assert experts.tokens_routed - routed == (5 + 2 * steps) * top_k * 2
        # Where the K-quants read int8 activations (x/d rounded, d = max|x|/127 per 256 values), the two
        # paths' fp32 rounding apart (libm's exp against torch's) can land one value on the other side of
        # a rounding step, which moves a product by d·|w| there: a step's logits then differ by up to
        # the int8 form's own distance from the float model (observed 2.5e-2 of |logit| ≤ 3.2 once in 7
        # steps on AVX-512). The int16 form has no such steps: the scalar kernels hold the two paths to
        # fp32 rounding.
        if NAT.quant_isa() in INT8_ISAS:
            tol = quant_logit_tolerance() * float(module_rows.abs().max())
            torch.testing.assert_close(native_rows, module_rows, rtol=0, atol=tol)
            assert NAT.select_quant_isa("scalar")
            try:
                native_rows, module_rows = native_and_module_logits(engine, IDS, prefill=5)
            finally:
                NAT.select_quant_isa("auto")
    torch.testing.assert_close(native_rows, module_rows, rtol=1e-4, atol=1e-4)


def two_chats_step(engine, max_tokens: int | None = None):
    """Two chats of unequal pasts in one native step, then the same by the modules: (native logits (2, V),
    module logits (2, V)); each chat's prompt chunk runs the modules. max_tokens: a MoE model's routed
    layers' bound on their tokens, else the engine's."""
    from engine.runtime.cpu_decode import routed_experts

    parts, steps = engine.backend.parts, engine.backend.generator.graphs
    kv, model = parts.kv, parts.model
    if max_tokens is not None:
        for plan, mlp in zip(steps.plans, steps.moe):
            plan.set_routed(**{**routed_experts(mlp), "max_tokens": max_tokens})
    a, b = kv.new_sequence(), kv.new_sequence()
    with torch.inference_mode():
        for seq, chunk in ((a, IDS[:7]), (b, IDS[:3])):
            positions = kv.begin_step([seq], len(chunk))
            assert steps.step(torch.tensor([chunk]), positions) is None  # a prompt chunk
            model(torch.tensor([chunk]), positions, kv)
            kv.end_step()
        tokens = torch.tensor([[5], [9]])
        positions = kv.begin_step([a, b], 1)
        by_native = steps.step(tokens, positions)
        kv.end_step()
        kv.crop(a, 7), kv.crop(b, 3)
        positions = kv.begin_step([a, b], 1)
        by_modules = model(tokens, positions, kv)
        kv.end_step()
    return by_native, by_modules


@pytest.mark.parametrize("max_tokens", [None, 1])  # 1: a batch of two leaves the experts to the executor
def test_a_batch_of_moe_chats_routes_each_token_on_its_own(tmp_path, max_tokens):
    pytest.importorskip("llama_cpp")
    from test_quant_experts_gguf import write_quantised

    path = write_quantised(tmp_path, "qwen3_moe", "Q4_K_M")
    config = EngineConfig(model=str(path), backend="tandem", device="cpu", max_batch=2, block_size=4)
    with closing(Engine(config)) as engine:
        experts = engine.backend.parts.model.model.layers[1].mlp.experts
        calls = []
        run = experts.run
        experts.run = lambda *a: calls.append(a[2].shape) or run(*a)  # the executor's own runs
        by_native, by_modules = two_chats_step(engine, max_tokens)
    # the executor (one for both layers) sees the batch's (2, k) choices from the modules' step, and from
    # the native step only where it left the experts to it
    assert calls.count((2, 2)) == (4 if max_tokens == 1 else 2)
    torch.testing.assert_close(by_native, by_modules, rtol=1e-3, atol=1e-3)
    assert by_native.abs().max() > 0.1


def test_generation_takes_the_native_steps_and_answers_alike(tmp_path):
    from engine.api import GenerationRequest

    request = GenerationRequest(prompt_ids=IDS[:6], max_new_tokens=10, greedy=True, ignore_eos=True)
    with closing(engine_for(write_quantised_llama(tmp_path / "q.gguf"))) as engine:
        native_ids = engine.generate(request).token_ids
        counts = engine.info()["cpu_decode"]
        generator = engine.backend.generator
        steps, generator.graphs = generator.graphs, None
        module_ids = engine.generate(request).token_ids
        generator.graphs = steps
    assert counts["native_steps"] >= 9 and counts["module_steps"] == 0
    assert native_ids == module_ids


def test_a_batch_of_chats_steps_natively_as_the_modules(tmp_path):
    # two chats of unequal pasts in one step: the modules pad and mask, the native call reads each
    # chat's own rows; a prompt chunk still runs the modules
    config = EngineConfig(model=str(write_quantised_llama(tmp_path / "q.gguf")), backend="tandem", device="cpu",
                          max_batch=2, block_size=4)
    with closing(Engine(config)) as engine:
        by_native, by_modules = two_chats_step(engine)
        steps = engine.backend.generator.graphs
        assert steps.telemetry() == {"layers": 2, "routed_layers": 0, "native_steps": 1, "module_steps": 2}
    assert by_native.shape == (2, 96)
    # the modules attend over the padded batch with torch's SDPA, the native call with its own kernel
    torch.testing.assert_close(by_native, by_modules, rtol=1e-3, atol=1e-3)


def test_float_weights_keep_the_modules_and_say_why(tmp_path):
    with closing(engine_for(write_quantised_llama(tmp_path / "q.gguf"), dtype="float32")) as engine:
        assert engine.info()["cpu_decode"] == {"off": "attention weights not all in blocks on the CPU"}
        assert engine.backend.generator.graphs is None


def test_the_native_router_checks_its_experts():
    q8 = torch.zeros(128, 68, dtype=torch.uint8)  # Q8_0 rows of 64 weights
    o = np.array([[q8.data_ptr(), 8, 64, 68]], dtype=np.int64)
    qkv = np.array([[q8.data_ptr(), 8, 128, 68]], dtype=np.int64)
    norm, cache, router = torch.ones(64), torch.zeros(8, 2, 16), torch.zeros(4, 64)
    none = np.zeros((0, 4), dtype=np.int64)
    layer = NAT.DecodeLayer(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, rotary=16, ffn=0, kv_slots=8, norm_eps=1e-5,
                            qk_norm_eps=0.0, scale=0.25, norm1=norm.data_ptr(), norm2=norm.data_ptr(), q_norm=0, k_norm=0,
                            qkv=qkv, qkv_bias=0, o=o, gate_up=none, down=none, k_cache=cache.data_ptr(),
                            v_cache=cache.data_ptr(), kv_dtype=0)
    blocks = np.full((2, 3), q8.data_ptr(), dtype=np.int64)
    good = dict(router=router.data_ptr(), n_experts=4, top_k=2, renormalise=True, group=np.array([0, 1, 0, 1]),
                blocks=blocks, gate_type=8, up_type=8, down_type=8, inter=64, max_tokens=4)
    layer.set_routed(**good)
    for bad, message in [(dict(top_k=5), "k ≤ E"), (dict(group=np.array([0, 1, 2, 1])), "out of range"),
                         (dict(group=np.array([0, 1])), r"group must be int64 \(E,\)"),
                         (dict(gate_type=11), "unknown quantised block type 11"),
                         (dict(inter=48), "multiple of the type's block"), (dict(router=0), "router")]:
        with pytest.raises(ValueError, match=message):
            layer.set_routed(**{**good, **bad})


def test_the_native_layer_checks_its_shapes_and_rows():
    q8 = torch.zeros(96, 2 * 34, dtype=torch.uint8)  # Q8_0 rows of 64 weights
    o = np.array([[q8.data_ptr(), 8, 64, 68]], dtype=np.int64)
    norm, cache = torch.ones(64), torch.zeros(8, 2, 16)
    none = np.zeros((0, 4), dtype=np.int64)
    shape = dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, rotary=16, ffn=0, kv_slots=8, norm_eps=1e-5, qk_norm_eps=0.0,
                 scale=0.25, norm1=norm.data_ptr(), norm2=norm.data_ptr(), q_norm=0, k_norm=0, qkv_bias=0,
                 gate_up=none, down=none, k_cache=cache.data_ptr(), v_cache=cache.data_ptr(), kv_dtype=0)
    with pytest.raises(ValueError, match="qkv rows"):
        NAT.DecodeLayer(qkv=o, o=o, **shape)  # 64 rows where q, k and v need 4·16 + 2·2·16 = 128
    qkv = np.array([[q8.data_ptr(), 8, 96, 68], [q8.data_ptr(), 8, 32, 68]], dtype=np.int64)
    layer = NAT.DecodeLayer(qkv=qkv, o=o, **shape)
    assert not layer.has_ffn
    x, normed, angles = torch.ones(64), torch.empty(64), torch.zeros(16)
    pointers = (x.data_ptr(), normed.data_ptr(), angles.data_ptr(), angles.data_ptr())

    def step(write, runs, offsets):
        layer.step(*pointers, np.array(write), np.array(runs), np.array(offsets), 1)

    with pytest.raises(ValueError, match="written row"):
        step([5], [[0, 3]], [0, 1])
    with pytest.raises(ValueError, match="in the cache"):
        step([2], [[0, 3], [6, 4]], [0, 2])  # slots 6–9 of a cache of 8
    with pytest.raises(ValueError, match="offsets"):
        step([2], [[0, 3]], [0, 2])  # a run that is not there
    step([6], [[0, 3], [6, 1]], [0, 2])
    assert torch.equal(x, torch.ones(64))  # zero weights: attention adds nothing to the residual


def test_builtin_upcycled_copies_route_in_the_native_call_as_one_ffn():
    """The built-in upcycled MoE's experts are copies of one FFN: every layer routes inside its native
    call, which merges a token's choices of the one FFN into a pair of their summed weight (the FFN once
    per token, as the executor computes it): logits as the modules', each choice counted as routed."""
    with closing(Engine(EngineConfig(model="builtin:smollm2-135m-moe", backend="tandem", device="cpu"))) as engine:
        info = engine.info()["cpu_decode"]
        assert info["routed_layers"] == info["layers"] == engine.backend.parts.args.n_layers
        experts = engine.backend.parts.model.model.layers[0].mlp.experts
        routed = experts.tokens_routed
        native_rows, module_rows = native_and_module_logits(engine, IDS, prefill=5)
        top_k, layers = engine.backend.parts.args.top_k, info["layers"]
        assert experts.tokens_routed - routed == (5 + 2 * (len(IDS) - 5)) * top_k * layers
    # The call's expert kernel takes the activations quantised per block where the module's products over
    # the one FFN do not: over 30 layers of Q4_1 that is a few 1e-3 of logits of order 10, as far apart as
    # the dense model's own native and module steps are (7e-3 on these tokens); the choices agree.
    torch.testing.assert_close(native_rows, module_rows, rtol=0, atol=1e-2)
    assert torch.equal(native_rows.argmax(-1), module_rows.argmax(-1))


def test_builtin_upcycled_moe_reads_a_prompt_as_its_dense_model_does():
    """A prompt chunk through an upcycled MoE layer (copies of one FFN) takes the dense layer's fp32 tiles,
    not routed experts' (bf16 where the CPU multiplies bf16): the same products as the dense FFN, then
    the token's weights, which sum to 1. With bf16 tiles they differed by 0.4% of the output's largest."""
    with closing(Engine(EngineConfig(model="builtin:smollm2-135m", backend="tandem", device="cpu"))) as dense, \
            closing(Engine(EngineConfig(model="builtin:smollm2-135m-moe", backend="tandem", device="cpu"))) as moe:
        x = torch.randn(200, dense.backend.parts.args.dim, generator=torch.Generator().manual_seed(0))  # > 16 tokens: tiles
        with torch.inference_mode():
            want = dense.backend.parts.model.model.layers[3].mlp(x)
            got = moe.backend.parts.model.model.layers[3].mlp(x.view(1, 200, -1)).view(200, -1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
