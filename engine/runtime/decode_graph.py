"""CUDA graphs of the decode step: the whole model's forward for B sequences, one token each, replayed.

A decode step of an MoE model launches ~70 small kernels per layer; eagerly, Python and the launch
path take ~2 ms per layer on a fast host, far more than the kernels' own time.
Captured once per batch size, the step becomes one graph launch.

What makes the step capturable: the resident KV puts the step's inputs (write slots, positions, key
counts, block table) at fixed device addresses and the paged kernel sizes its splits on the device
(engine/kv/resident.py); the resident experts find their groups without reading back to the host
(engine/kernels/experts_gpu.py, moe_decode_gpu.py); recurrent layers (Qwen3.5's Gated DeltaNet) read
and write their states in fixed buffers per batch size (engine/kv/recurrent.py: `fix_states`).
Hybrid KV decides placement on the host every step and runs eagerly.

Offloaded experts also decide on the host, per layer (LRU lookup, fills, a CPU share), so their step
is captured in pieces: one graph from each MoE layer's routing to the next (attention, norms, router,
residuals), cut where the layer hands its tokens to the experts. A replay runs the pieces in order and,
at each cut, the executor's host half on the captured inputs (x, ids, weights at fixed addresses): it
places the experts, publishes the layer's slot map, launches the layer's GPU side over the slots (a
small graph of its own, so the device computes the cached experts while the CPU computes its set)
and writes the CPU set's sum into a fixed buffer, which the next piece adds (up to 8 tokens; larger
batches run the executor whole between pieces, writing a fixed output buffer).

Offloaded experts with a device table (`adaptive` on a GPU) can also run the whole step as one graph:
each layer's kernel finds its experts in cache slots or reads them in place from the pinned host store,
and the host manages the cache between steps. Which form a step replays, what stands in for the experts
while a form is captured and the host work around a replay are the executor's hooks (ExpertExecutor;
engine/experts/graph_forms.py for offloaded experts): this module knows nothing of placement.

The first step of a batch size runs eagerly on a side stream (Triton compiles, cuBLAS picks its
algorithms), then is captured and replayed: K, V of that step are written twice with the same values
(and offloaded experts run twice for it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.experts.executor import GROUPED_MAX_TOKENS, ExpertExecutor
from engine.kernels.cuda_capture import GeneratorState
from engine.kv.resident import ResidentKV

log = logging.getLogger("tandem")


def unsupported_reason(kv, experts, device: torch.device, max_batch: int) -> str | None:
    """Why decode steps cannot be replayed as graphs here, or None when they can."""
    if not isinstance(getattr(kv, "inner", kv), ResidentKV):  # (a hybrid model's KV wraps the attention layers')
        return f"the {kv.policy} KV decides placement on the host every step"
    if device.type != "cuda":
        return "graphs need CUDA"
    if not kv.paged:
        return "the paged decode kernel does not take this model's head dim (powers of two ≥ 16 only)"
    if experts is not None:
        return experts.capture_problem(device, max_batch)
    if max_batch > GROUPED_MAX_TOKENS:
        return f"max_batch above {GROUPED_MAX_TOKENS} takes the per-expert path, which syncs with the host"
    return None


@dataclass
class _Piece:
    """One captured stretch of the step; `layer` set: the host runs that MoE layer's experts after it."""
    graph: torch.cuda.CUDAGraph
    layer: int | None = None
    x: torch.Tensor | None = None  # (B, H) the layer's expert input, written by this piece
    ids: torch.Tensor | None = None  # (B, k)
    weights: torch.Tensor | None = None  # (B, k)
    routed: torch.Tensor | None = None  # (B or 2B, k) routing and the next layer's prediction (lookahead)
    out: torch.Tensor | None = None  # (B, H) the experts' sum, written by the host, read by the next piece
    cpu_buf: torch.Tensor | None = None  # (B, H) fp32 instead: the CPU set's sum, which the next piece adds
    gpu_graph: torch.cuda.CUDAGraph | None = None  # the layer's GPU side over the slots, replayed by the host
    # half once the slot map is published, while the CPU set runs (its sum is read by the next piece)


class _Cut(ExpertExecutor):
    """Stands in for offloaded experts while a step is captured: ends the piece that routed this
    layer (and predicted the next one's routing), captures the layer's GPU side over the slots as a
    graph of its own, and starts the next piece, which adds a fixed buffer for the CPU set's sum (a
    few tokens); or the next piece reads a fixed buffer the host fills with the whole experts' sum."""

    policy = "capture-cut"
    stands_in = True  # the MoE layers' expert forms stay with the executor it stands in for

    def __init__(self, pool, home: torch.cuda.Stream, experts: ExpertExecutor | None = None):
        self.pool, self.home, self.experts = pool, home, experts  # home: the stream replays run on
        self.pieces, self.graph = [], None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (the app polling memory) cannot spoil the capture
        self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self, **cut) -> None:
        graph, self.graph = self.graph, None
        graph.capture_end()
        if self.pool is None:
            self.pool = graph.pool()  # every piece allocates from one pool: tensors cross the cuts
        self.pieces.append(_Piece(graph, **cut))

    def abort(self) -> None:
        if self.graph is not None:
            try:
                self.graph.capture_end()
            except Exception:  # the capture is broken already; ending it only tidies the stream
                pass
            self.graph = None

    def run(self, layer, x, ids, weights):
        routed = self.experts.lookahead(layer, x, ids)  # captured: the prediction costs no launch later
        device_side = self.experts.device_side_ok(x)  # the GPU side is captured here, not run by the host
        self.end(layer=layer, x=x, ids=ids, weights=weights, routed=routed)
        with torch.cuda.stream(self.home):  # outside any capture, owned by the replaying stream
            # the host writes it between replays
            buf = torch.empty(x.shape, dtype=torch.float32 if device_side else x.dtype, device=x.device)
        self.begin()
        if not device_side:
            self.pieces[-1].out = buf
            return buf
        self.pieces[-1].cpu_buf = buf
        on_slots = self.experts.gpu_side(layer, x, ids, weights)  # (B, H) or None (cpu-only)
        if on_slots is None:
            return buf.to(x.dtype)
        gpu_graph, self.graph = self.graph, None
        gpu_graph.capture_end()
        self.pieces[-1].gpu_graph = gpu_graph  # its own graph: the host half replays it before its CPU wait
        self.begin()
        return on_slots + buf.to(x.dtype)

    def telemetry(self) -> dict:
        return {}


class DecodeGraphs:
    """Captured decode forwards per batch size: one graph, or pieces cut at offloaded experts."""

    def __init__(self, model, kv, experts, device: torch.device, max_batch: int):
        """kv: a ResidentKV, or a RecurrentKV around one (hybrid models)."""
        self.model, self.kv, self.experts, self.device = model, kv, experts, device
        self.tokens = torch.zeros((max_batch, 1), dtype=torch.int64, device=device)  # (B, 1) static input
        self.steps: dict[tuple[int, str], tuple[list[_Piece], torch.Tensor]] = {}  # (B, form) → (pieces, logits (B, V))
        self.pool = None  # resident experts: one pool for every batch size (one graph each)
        self.failed: str | None = None  # set when a capture failed: every later step runs eagerly
        self.replays = 0
        self.launch_s = 0.0  # host seconds in the step's replay calls (the pieces' launches; the layers'
        # GPU-side graphs are launched inside the executor's host half and timed there)
        self.recurrent = getattr(kv, "recurrent", False)  # states in fixed buffers around each replay
        self.cut = experts is not None and experts.cut_at_layers
        self._moe = [layer.mlp for layer in model.model.layers if getattr(layer.mlp, "experts", None) is experts] \
            if self.cut else []

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """tokens (B, 1) on the host, positions (B, 1) from kv.begin_step → logits (B, V) fp32, or None
        when this step must run eagerly (the caller then runs the model itself)."""
        if self.failed is not None or not self.kv.replayable_step():
            return None
        B = tokens.shape[0]
        self.tokens[:B].copy_(tokens, non_blocking=True)
        experts = self.experts
        form = experts.graph_form(B) if experts is not None else "graph"
        if self.recurrent:
            self.kv.fix_states(B)
        entry = self.steps.get((B, form))
        if entry is None:
            entry = self._capture(B, positions, form)
            if entry is None:
                if self.recurrent:
                    self.kv.unfix_states()
                return None
            if self.recurrent:  # the captures' warm-ups moved the states on: this step's again
                self.kv.fix_states(B)
        if experts is not None:
            experts.before_replay(B, form)
        pieces, logits = entry
        for piece in pieces:
            t0 = time.perf_counter()
            piece.graph.replay()
            self.launch_s += time.perf_counter() - t0
            if piece.layer is not None:  # the host places and runs this layer's experts, eagerly
                self.experts.run(piece.layer, piece.x, piece.ids, piece.weights, piece.routed, out=piece.out,
                                 cpu_buf=piece.cpu_buf,
                                 between=piece.gpu_graph.replay if piece.gpu_graph is not None else None)
        if experts is not None:
            experts.after_replay(B, form, B * self.model.args.top_k)
        if self.recurrent:
            self.kv.replayed_step()
        self.replays += 1
        return logits.clone()  # the graph's output buffer is overwritten by the next replay

    def _capture(self, B: int, positions: torch.Tensor, form: str):
        """form: the executor's `graph_form`: "graph" (one graph), "pieces" (cut at each offloaded MoE
        layer) or another whole-step form, whose stand-in runs the MoE layers while it is captured."""
        tokens = self.tokens[:B]
        in_graph = self.experts.stand_in(form) if self.cut else None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            for mlp in self._moe if in_graph is not None else ():
                mlp.experts = in_graph
            with torch.cuda.stream(side):  # warm-up: compiles kernels, settles cuBLAS workspaces
                self.model(tokens, positions, self.kv)
        finally:
            for mlp in self._moe:
                mlp.experts = self.experts
        torch.cuda.current_stream(self.device).wait_stream(side)
        pieces = self.cut and form == "pieces"
        # pieces of one batch size share a pool of their own; single graphs share one across sizes
        cut = _Cut(None if self.cut else self.pool, torch.cuda.current_stream(self.device),
                   self.experts if pieces else None)
        failure, rng = None, GeneratorState(self.device)
        try:
            for mlp in self._moe:
                mlp.experts = in_graph or cut
            with torch.cuda.stream(side):
                try:
                    cut.begin()
                    logits = self.model(tokens, positions, self.kv)  # (B, V) fp32, a buffer of the pool
                    cut.end()
                except Exception as e:  # an op that syncs with the host or is not capturable: stay eager
                    cut.abort()  # on the capturing stream: a capture must end where it began
                    rng.restore()  # the failed capture left the default generator in capture mode
                    failure = e
        finally:
            for mlp in self._moe:
                mlp.experts = self.experts
        if failure is not None:
            text = str(failure).strip()
            self.failed = f"{type(failure).__name__}: {text.splitlines()[0] if text else ''}"
            log.warning("decode steps run without CUDA graphs: capture failed (%s)", self.failed)
            torch.cuda.synchronize(self.device)
            return None
        torch.cuda.current_stream(self.device).wait_stream(side)
        if not self.cut:
            self.pool = cut.pool
        self.steps[(B, form)] = (cut.pieces, logits)
        log.info("captured the decode step for batch %d (%s, %d piece%s)", B, form, len(cut.pieces),
                 "" if len(cut.pieces) == 1 else "s")
        return self.steps[(B, form)]

    def telemetry(self) -> dict:
        pieces = {B: len(p) for (B, form), (p, _) in self.steps.items() if form == "pieces"}
        forms: dict[int, list[str]] = {}
        for B, form in sorted(self.steps):
            forms.setdefault(B, []).append(form)
        return {"captured_batches": sorted(forms), "captured_forms": forms, "replays": self.replays,
                "launch_host_s": round(self.launch_s, 4),
                "failed": self.failed, **({"pieces_per_step": pieces} if self.cut else {})}

    def close(self) -> None:
        self.steps.clear()
        self.pool = None
