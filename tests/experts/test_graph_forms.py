"""The decode-graph hooks of offloaded experts (engine/experts/graph_forms.py), driven as
engine/runtime/decode_graph.py drives them, on a CPU simulation of the graph step: where a replay
would run, the layers run eagerly through what the executor put in the experts' place (the stand-in
of the one graph, or the host half of pieces). With a device table every step the table holds is the
one graph, larger ones pieces; outputs equal resident execution in either, and across a switch."""

import pytest
import torch

pytest.importorskip("triton")  # the one graph's kernels run under Triton's interpreter here

from engine.experts.executor import ExpertExecutor, ResidentExperts  # noqa: E402
from engine.experts.offload import OffloadedExperts  # noqa: E402
from engine.experts.store import ExpertStore  # noqa: E402
from engine.experts.zero_copy import ZeroCopyDecode  # noqa: E402
from engine.kernels.experts_torch import moe_experts  # noqa: E402

L, E, H, I, K, MAX_TOKENS = 3, 6, 24, 16, 2, 4


def _offloaded(n_slots=5):
    g = torch.Generator().manual_seed(0)
    gate_up = [torch.randn(E, 2 * I, H, generator=g) / H**0.5 for _ in range(L)]
    down = [torch.randn(E, H, I, generator=g) / I**0.5 for _ in range(L)]
    store = ExpertStore.from_layers(gate_up, down, dtype=torch.float32, pin=False)
    ex = OffloadedExperts("adaptive", store, device=torch.device("cpu"), n_slots=n_slots, max_decode_tokens=MAX_TOKENS)
    # what _open_zero_copy makes on a GPU: the device table over the same cache
    ex.zero_copy = ZeroCopyDecode(store, ex.cache, torch.device("cpu"), MAX_TOKENS, window=ex._window)
    return ex, gate_up, down


def _step(ex, B, g, gate_up, down, stand_ins):
    """One decode step as DecodeGraphs.step runs it, each layer checked against resident."""
    form = ex.graph_form(B)
    if form not in stand_ins:  # the first step of a form is captured: its stand-in is made then
        stand_ins[form] = ex.stand_in(form)
    ex.before_replay(B, form)
    stand_in = stand_ins[form]
    for layer in range(L):
        x = torch.randn(B, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])
        w = torch.softmax(torch.randn(B, K, generator=g), -1)
        out = stand_in.run(layer, x, ids, w) if stand_in is not None else ex.run(layer, x, ids, w)
        torch.testing.assert_close(out, moe_experts(x, ids, w, gate_up[layer], down[layer]), atol=1e-5, rtol=1e-4)
    ex.after_replay(B, form, B * K)
    return form


def test_offloaded_experts_run_the_one_graph_where_the_table_holds_the_step_and_equal_resident():
    ex, gate_up, down = _offloaded()
    g = torch.Generator().manual_seed(1)
    stand_ins = {}
    # steps the table's logs hold are the one graph; a larger one is pieces, and the graph after it
    # replays from a table rebuilt from what pieces left in the LRU
    forms = [_step(ex, B, g, gate_up, down, stand_ins) for B in (2, 2, 1, MAX_TOKENS + 1, 2, MAX_TOKENS)]
    assert forms == ["graph", "graph", "graph", "pieces", "graph", "graph"]
    assert stand_ins["pieces"] is None  # pieces: the runtime cuts at each layer, the executor runs it
    assert stand_ins["graph"].stands_in and stand_ins["graph"].zero_copy is ex.zero_copy
    assert ex.zero_copy.steps == 5
    ex.close()


def test_without_a_device_table_every_step_is_pieces():
    ex, gate_up, down = _offloaded()
    ex.zero_copy = None  # policy on-demand, no Triton, a model with expert biases, ...
    assert ex.cut_at_layers and ex.graph_form(1) == "pieces" and ex.stand_in("pieces") is None
    _step(ex, 1, torch.Generator().manual_seed(2), gate_up, down, {})
    ex.close()


def test_the_hooks_default_to_an_executor_that_cannot_be_captured():
    class Other(ExpertExecutor):
        policy = "other"

        def run(self, layer, x, ids, weights):
            return x

        def telemetry(self):
            return {}

    other = Other()
    assert other.capture_problem(torch.device("cuda"), 1) == "the other expert policy cannot be captured"
    assert not other.cut_at_layers and other.graph_form(4) == "graph" and other.stand_in("graph") is None
    resident = ResidentExperts([torch.zeros(E, 2 * I, H)], [torch.zeros(E, H, I)])
    resident.after_replay(3, "graph", 3 * K)  # a replay routed what `run` would have counted
    assert resident.tokens_routed == 3 * K


@pytest.mark.parametrize("policy", ["adaptive", "on-demand", "static", "cpu-only"])
def test_every_policy_asks_for_the_one_graph(policy):
    """Every offload policy gets a device table wherever CUDA is (here, on the CPU, the reason is the
    missing GPU, not the policy)."""
    off = "needs CUDA and Triton"
    g = torch.Generator().manual_seed(0)
    gate_up = [torch.randn(E, 2 * I, H, generator=g) for _ in range(L)]
    down = [torch.randn(E, H, I, generator=g) for _ in range(L)]
    store = ExpertStore.from_layers(gate_up, down, dtype=torch.float32, pin=False)
    ex = OffloadedExperts(policy, store, device=torch.device("cpu"), n_slots=5, max_decode_tokens=MAX_TOKENS)
    assert ex.zero_copy is None and ex.zero_copy_off == off and ex.graph_form(1) == "pieces"
    ex.close()
