"""Decode steps replayed as CUDA graphs (engine/runtime/decode_graph.py) give what eager steps give.

On the CPU only the decision is checked (graphs need CUDA); on CUDA every family's tiny model
generates a batch of two prompts of different lengths with graphs and without, and the tokens must
be the same and the logits of each step equal to bf16 rounding.
"""

import pytest
import torch

from engine.api import GenerationRequest

from moe_helpers import PROMPT, tiny_engine

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _tiny_folder(tmp_path, family="qwen3_moe"):
    import test_mixtral
    import test_olmoe
    import test_qwen3_moe

    module = {"qwen3_moe": test_qwen3_moe, "mixtral": test_mixtral, "olmoe": test_olmoe}[family]
    wide = {} if family == "qwen3_moe" else {"hidden_size": 64}  # head dim 16: the paged kernel's smallest
    module.tiny(seed=5, **wide).save_pretrained(tmp_path / family)
    return tmp_path / family


def test_graphs_are_off_where_they_cannot_run(tmp_path):
    folder = _tiny_folder(tmp_path)
    engine = tiny_engine(folder)  # the CPU
    assert engine.info()["cuda_graphs"] == {"off": "graphs need CUDA"}
    assert engine.backend.generator.graphs is None
    engine.close()
    off = tiny_engine(folder, cuda_graphs=False)
    assert off.info()["cuda_graphs"] == {"off": "off in the config"}
    off.close()
    hybrid = tiny_engine(folder, kv_policy="gpu-centric", simulate_hybrid=True)
    assert hybrid.info()["cuda_graphs"]["off"] == "the gpu-centric KV decides placement on the host every step"
    hybrid.close()
    offloaded = tiny_engine(folder, expert_policy="on-demand", simulate_hybrid=True, expert_cache_slots=4)
    assert offloaded.info()["cuda_graphs"]["off"] == "graphs need CUDA"
    offloaded.close()


def test_offloaded_experts_are_captured_in_pieces_only_on_a_real_gpu():
    """The reasons, read from the objects alone: offloaded experts cut the step into pieces on CUDA;
    a simulated GPU side on the CPU is not captured."""
    from engine.experts.offload import OffloadedExperts
    from engine.runtime.decode_graph import unsupported_reason
    from engine.kv.resident import ResidentKV

    kv = ResidentKV.__new__(ResidentKV)
    kv.paged = True
    simulated = OffloadedExperts.__new__(OffloadedExperts)
    simulated.device = torch.device("cpu")
    cuda_dev = torch.device("cuda")
    assert unsupported_reason(kv, simulated, cuda_dev, 4) == "the offloaded experts' GPU side is simulated on the CPU"
    real = OffloadedExperts.__new__(OffloadedExperts)
    real.device = cuda_dev
    assert unsupported_reason(kv, real, cuda_dev, 64) is None  # the experts run outside the pieces: any batch
    assert unsupported_reason(kv, real, torch.device("cpu"), 4) == "graphs need CUDA"
    kv.paged = False
    assert "paged decode kernel" in unsupported_reason(kv, real, cuda_dev, 4)


def _batch(engine, n_new=12):
    requests = [GenerationRequest(prompt_ids=PROMPT, max_new_tokens=n_new, greedy=True, ignore_eos=True),
                GenerationRequest(prompt_ids=PROMPT[:5], max_new_tokens=n_new, greedy=True, ignore_eos=True)]
    return [r.token_ids for r in engine.generate_batch(requests)]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_graph_decode_equals_eager_decode(family, tmp_path):
    folder = _tiny_folder(tmp_path, family)
    eager = tiny_engine(folder, device="cuda", dtype="bfloat16", cuda_graphs=False)
    expected = [_batch(eager), eager.generate_ids(PROMPT, 12)]
    eager.close()
    graphed = tiny_engine(folder, device="cuda", dtype="bfloat16")
    got = [_batch(graphed), graphed.generate_ids(PROMPT, 12)]
    tel = graphed.info()["cuda_graphs"]
    assert tel["failed"] is None and tel["captured_batches"] == [1, 2] and tel["replays"] >= 2 * 10
    assert tel["launch_host_s"] > 0  # the replays' host time is measured
    assert got == expected
    graphed.close()


@cuda
@pytest.mark.cuda
def test_graphs_follow_a_kv_policy_switch(tmp_path):
    """A graph holds the KV's addresses: switching the KV away turns graphs off, switching back
    captures anew, and the tokens stay those of eager decode."""
    folder = _tiny_folder(tmp_path)
    engine = tiny_engine(folder, device="cuda", dtype="bfloat16")
    first = engine.generate_ids(PROMPT, 10)
    engine.backend.set_kv_policy("gpu-centric")
    assert "KV" in engine.info()["cuda_graphs"]["off"]
    hybrid = engine.generate_ids(PROMPT, 10)
    engine.backend.set_kv_policy("resident")
    again = engine.generate_ids(PROMPT, 10)
    assert engine.info()["cuda_graphs"]["captured_batches"] == [1]
    assert first == again and len(hybrid) == 10  # the hybrid path rounds differently in bf16
    engine.close()


@cuda
@pytest.mark.cuda
def test_a_failed_capture_falls_back_to_eager_steps(tmp_path, monkeypatch):
    """An op that reads back to the host cannot be captured: the engine says so once and keeps
    decoding eagerly, with the tokens of an engine that never tried."""
    folder = _tiny_folder(tmp_path)
    eager = tiny_engine(folder, device="cuda", dtype="bfloat16", cuda_graphs=False)
    expected = eager.generate_ids(PROMPT, 8)
    eager.close()
    engine = tiny_engine(folder, device="cuda", dtype="bfloat16")
    norm = engine.backend.parts.model.model.norm
    real_forward = norm.forward

    def syncing_forward(x):
        if torch.cuda.is_current_stream_capturing():
            x.sum().item()  # a host read-back: illegal while capturing
        return real_forward(x)

    monkeypatch.setattr(norm, "forward", syncing_forward)
    assert engine.generate_ids(PROMPT, 8) == expected
    tel = engine.info()["cuda_graphs"]
    assert tel["failed"] and tel["captured_batches"] == [] and tel["replays"] == 0
    assert engine.generate_ids(PROMPT, 8) == expected  # and the engine stays usable
    assert torch.isfinite(torch.randn(100, device="cuda")).all()  # the default generator left capture mode
    engine.close()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("policy,slots", [("on-demand", 3), ("adaptive", 5), ("cpu-only", 0)])
def test_offloaded_experts_replay_their_captured_steps(policy, slots, tmp_path):
    """With offloaded experts on a GPU the decode step is one graph: the device table points each
    expert at a slot or the store, and the policy's split sends misses over the link or to the CPU.
    Small caches: fills, evictions and CPU sets happen during replays, and the tokens are those of
    eager steps with the same policy. fp32: the first step of each batch size runs the experts twice,
    so placements (CPU or GPU) differ from the eager run's, and bf16 would round the two sides
    differently."""
    folder = _tiny_folder(tmp_path)
    config = dict(device="cuda", dtype="float32", expert_policy=policy, expert_cache_slots=slots)
    eager = tiny_engine(folder, cuda_graphs=False, **config)
    expected = [_batch(eager), eager.generate_ids(PROMPT, 12)]
    eager.close()
    graphed = tiny_engine(folder, **config)
    got = [_batch(graphed), graphed.generate_ids(PROMPT, 12)]
    tel = graphed.info()["cuda_graphs"]
    assert tel["failed"] is None and tel["captured_batches"] == [1, 2] and tel["replays"] >= 2 * 10
    assert tel["launch_host_s"] > 0  # the replays' host time is measured
    experts = graphed.stats().experts
    assert experts["hits"] + experts["misses"] > 0
    # every step the one graph: on-demand's misses read in place, cpu-only's all on the CPU, adaptive's split
    zc = experts["zero_copy"]
    assert zc["graph_steps"] > 0 and tel["captured_forms"] == {1: ["graph"], 2: ["graph"]}
    assert tel["pieces_per_step"] == {}
    if policy == "on-demand":
        assert zc["zero_copy_experts"] > 0 and zc["cpu_experts"] == 0
    if policy == "cpu-only":
        assert zc["cpu_experts"] > 0 and zc["zero_copy_experts"] == 0 and zc["graph_fills"] == 0
    assert got == expected
    graphed.close()


def test_a_step_replays_the_form_the_executor_names_and_calls_its_hooks_around_it():
    """DecodeGraphs.step on the CPU with the captures stood in for (graphs need CUDA): the form comes
    from the executor, a new form is captured at its first step, and the executor hears of each replay
    (before, after, with the pairs routed) in order."""
    from types import SimpleNamespace

    from engine.experts.executor import ExpertExecutor
    from engine.runtime.decode_graph import DecodeGraphs, _Piece

    calls = []

    class Recording(ExpertExecutor):
        policy = "recording"

        def __init__(self):
            self.forms = iter(["pieces", "pieces", "graph"])

        def run(self, layer, x, ids, weights):
            raise AssertionError("a replay with no cut runs no layer on the host")

        def telemetry(self):
            return {}

        def graph_form(self, B):
            return next(self.forms)

        def before_replay(self, B, form):
            calls.append(("before", B, form))

        def after_replay(self, B, form, pairs):
            calls.append(("after", B, form, pairs))

    class Replay:
        def __init__(self, form):
            self.form = form

        def replay(self):
            calls.append(("replay", self.form))

    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.model = SimpleNamespace(args=SimpleNamespace(top_k=8))
    graphs.kv = SimpleNamespace(replayable_step=lambda: True)
    graphs.experts, graphs.cut, graphs.recurrent = Recording(), False, False
    graphs.tokens = torch.zeros((4, 1), dtype=torch.int64)
    graphs.steps, graphs.failed, graphs.replays, graphs.launch_s = {}, None, 0, 0.0

    def capture(B, positions, form):
        calls.append(("capture", form))
        graphs.steps[(B, form)] = ([_Piece(Replay(form))], torch.full((B, 5), float(len(form))))
        return graphs.steps[(B, form)]

    graphs._capture = capture
    tokens, positions = torch.ones((2, 1), dtype=torch.int64), torch.zeros((2, 1), dtype=torch.int64)
    first = graphs.step(tokens, positions)
    assert calls == [("capture", "pieces"), ("before", 2, "pieces"), ("replay", "pieces"),
                     ("after", 2, "pieces", 16)]
    assert first.shape == (2, 5) and first[0, 0] == len("pieces")
    calls.clear()
    graphs.step(tokens, positions)  # captured already: replayed, no capture
    graphs.step(tokens, positions)  # a new form: captured at its first step
    assert calls == [("before", 2, "pieces"), ("replay", "pieces"), ("after", 2, "pieces", 16),
                     ("capture", "graph"), ("before", 2, "graph"), ("replay", "graph"),
                     ("after", 2, "graph", 16)]
    assert graphs.replays == 3
