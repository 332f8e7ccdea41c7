"""How offloaded experts take part in captured decode steps: which form a step replays, and the host
work around the replay (the ExpertExecutor's decode-graph hooks, which engine/runtime/decode_graph.py
drives without knowing what is inside).

Offloaded experts decide on the host, so their step is captured in pieces, cut at each MoE layer, and
the host runs the layer between pieces (`OffloadedExperts.run`). With a device table
(engine/experts/zero_copy.py, on a GPU) a decode step of up to its max_tokens is one graph instead,
whose kernels find each expert in a slot, read it in place or hand it to the CPU through its mailbox
(engine/experts/cpu_mailbox.py), as the policy's split of the layer's misses says. It decoded 2x
adaptive's pieces at one chat and at four (BF16, 8 GB, H100; benchmarks/h200/2026-12-07-miss-split-h100/);
pieces remain for larger steps, experts with biases and the simulated GPU.
"""

from __future__ import annotations

import torch

from engine.experts.executor import ExpertExecutor

class InGraph(ExpertExecutor):
    """Stands in for offloaded experts while a whole-step graph is warmed up and captured: device
    work only, through the expert table."""

    policy = "in-graph"
    stands_in = True  # the MoE layers' expert forms stay with the executor it stands in for

    def __init__(self, zero_copy):
        self.zero_copy = zero_copy

    def run(self, layer, x, ids, weights):
        return self.zero_copy.run(layer, x, ids, weights)

    def telemetry(self) -> dict:
        return {}


class GraphForms:
    """Mixed into OffloadedExperts, which supplies `device` and `zero_copy` (or None): the decode-graph
    hooks of ExpertExecutor for experts placed on the host's word."""

    cut_at_layers = True

    def capture_problem(self, device: torch.device, max_batch: int) -> str | None:
        # the experts run outside the pieces, so any batch size is captured
        return None if self.device.type == "cuda" else "the offloaded experts' GPU side is simulated on the CPU"

    def graph_form(self, B: int) -> str:
        zc = self.zero_copy
        return "graph" if zc is not None and B <= zc.max_tokens and zc.runnable else "pieces"

    def stand_in(self, form: str) -> ExpertExecutor | None:
        if form != "graph":
            return None  # pieces: the runtime's cut stands in
        self.zero_copy.before_step()  # a valid table for the warm-up
        return InGraph(self.zero_copy)

    def before_replay(self, B: int, form: str) -> None:
        if form == "graph":  # (a pieces step's host halves settle the table themselves: leave)
            self.zero_copy.before_step()

    def after_replay(self, B: int, form: str, pairs: int) -> None:
        if form == "graph":
            self.zero_copy.after_step(B)
