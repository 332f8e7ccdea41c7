"""CpuMailbox: the CPU computes part of each layer's misses inside the one decode graph.

The graph reads every miss over PCIe (engine/experts/zero_copy.py); where the cache is tight (32K
with one chat) that binds the step to the link while the CPU idles. Seed 004 sends part of the
misses to the CPU instead, sized so that both sides finish together. Between layers of a
graph there is no host call to split them, so the device splits them (`post`, in
engine/kernels/cpu_mailbox_gpu.py), hands the CPU's share over through pinned host memory, and the
native worker (native/cpu_mailbox.h) answers there; the layer's sum kernel waits for the answer. Over
a store of GGUF blocks the worker runs the quantised CPU set (native/quant_moe.h) on the blocks
where they lie in the store.

The mailbox's kernels are in the one graph wherever misses can happen (the cache holds fewer slots
than the store has experts). How many of a layer's misses go to the CPU is decided on the device, per
layer, from three costs that MissSplit reads from the corrected cost model (seed 004's split: both sides
finish together).

This object owns the two pinned regions, the device's small scalars and the worker, and tears them
down in reverse order: the device is synchronised (no kernel waits on the worker), the worker thread
stops, then the memory goes.

TANDEM_GRAPH_CPU=0 keeps the mailbox closed (every miss read over PCIe): the remedy a failed CPU
share names.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from engine.experts.measured_costs import MeasuredCosts
from engine.kernels import cpu_mailbox_gpu, native

HEADER_WORDS = 16  # int64 words before the arrays: the sequence number's line, then layer and rows (to_cpu)
# Reads of host memory before a waiting sum kernel gives up and flags the step (about 1 µs each over
# PCIe: seconds; the interpreter's are slower, and its worker answers before the kernel even starts).
MAX_POLLS = 1 << 22


# The link's cost of a policy that never reads misses over it (static, cpu-only): finite, so the
# device's products of it stay numbers (m · it in fp32 for m ≤ 64), and far past any CPU's.
LINK_NEVER_MS = 1e9
# Posts the worker must have answered before its measured costs replace the cost model's: two decode
# steps of a 16-layer model, enough spread in the experts a post carries (1 to top-k) for a line.
MEASURE_POSTS = 32
# A window's expert counts must spread by this much (variance, experts²) for its line's slope; below
# it only the per-expert cost is updated, the per-post one kept.
MIN_SPREAD = 0.25


def graph_cpu_enabled() -> bool:
    """TANDEM_GRAPH_CPU=0 keeps the CPU out of the one graph (every miss read over PCIe)."""
    return os.environ.get("TANDEM_GRAPH_CPU", "1") != "0"


class MissSplit:
    """The three costs (ms) by which the device splits a layer's m misses (engine/kernels/
    cpu_mailbox_gpu.py): c go to the CPU where max((m − c) · link_ms, handoff_ms + c · cpu_ms) is least.

    They are read from the decode side of the one corrected cost model (engine/experts/measured_costs.py),
    not kept apart from it: link_ms is one expert read in place over PCIe (the model's zero-copy rate,
    or LINK_NEVER_MS for a policy whose misses never cross the link), handoff_ms + c · cpu_ms a post of c
    experts on the worker. Once the worker has answered MEASURE_POSTS posts, the least-squares line
    through its latest window of posts (time against c) becomes the model's decode CPU costs, which the
    pieces' planner reads too. A post's fixed part is large: waking the team and splitting one expert's
    rows over it cost about as much as two more experts (H100 host, 15 threads: ~0.25 ms a post, ~0.07
    ms an expert)."""

    def __init__(self, measured: MeasuredCosts, link: bool = True):
        self.measured, self.uses_link = measured, link
        self.is_measured = False  # the CPU costs are the worker's own
        self._mark = np.zeros(5)  # the worker's fit_sums at the start of the window

    def values(self) -> tuple[float, float, float]:
        """(link_ms, cpu_ms, handoff_ms) as the decode model says now."""
        costs = self.measured.model("decode")
        return (costs.zero_copy_ms() if self.uses_link else LINK_NEVER_MS, costs.cpu_expert_ms(1),
                costs.cpu_correction * costs.cpu_overhead_ms)

    def observe(self, fit_sums) -> bool:
        """The worker's cumulative (posts, Σc, Σc², Σt, Σc·t), t in s → whether the CPU costs changed."""
        sums = np.asarray(fit_sums, dtype=np.float64)
        n, sc, scc, st, sct = sums - self._mark
        if n < MEASURE_POSTS or sc <= 0:
            return False
        self._mark = sums
        mean_c, mean_t = sc / n, st / n
        spread = scc / n - mean_c ** 2
        slope = (sct / n - mean_c * mean_t) / spread if spread >= MIN_SPREAD else -1.0
        intercept = mean_t - slope * mean_c
        if slope > 0 and intercept >= 0:
            expert_ms, post_ms = 1e3 * slope, 1e3 * intercept
        else:  # no usable line: the per-post cost stays, the experts take the rest
            post_ms = self.values()[2]
            expert_ms = max(1e3 * (st - post_ms * 1e-3 * n) / sc, 1e-3)
        self.measured.observe_cpu_line("decode", expert_ms, post_ms)
        self.is_measured = True
        return True

    def telemetry(self) -> dict:
        link_ms, cpu_ms, handoff_ms = self.values()
        return {"link_ms": round(link_ms, 4), "cpu_ms": round(cpu_ms, 4), "handoff_ms": round(handoff_ms, 4),
                "cpu_measured": self.is_measured}


def worker_threads() -> int:
    """The worker's team: every core the native kernels use but one. While a graph step runs, the
    driving thread waits for it in the CUDA runtime, spinning (the runtime's default where cores
    outnumber contexts), so it holds a core for the whole step. A team that counted that core would
    share it with the spinner, and a region split statically between its threads waits for the one
    that lost its core: a scheduler time slice, milliseconds, where a layer's answer takes ~0.5."""
    return max(1, native.threads() - 1)


def _words(n_bytes: int) -> int:
    """int64 words for n_bytes, rounded up to whole 64-byte lines."""
    return math.ceil(n_bytes / 64) * 8


class CpuMailbox:
    def __init__(self, store, device: torch.device, max_rows: int, top_k: int,
                 split: tuple[float, float, float], threads: int | None = None, max_polls: int = MAX_POLLS):
        """store: the ExpertStore the CPU computes from; max_rows: tokens a step carries; split: the
        device's (link_ms, cpu_ms, handoff_ms) to begin with (MissSplit); threads: the worker's team
        (worker_threads() by default). Raises RuntimeError without the native extension."""
        nat = native.module()
        if nat is None or not hasattr(nat, "CpuMailbox"):
            raise RuntimeError(f"the CPU mailbox needs the native extension ({native.load_error() or 'too old'})")
        if store.dtype not in native.DTYPE_CODES:
            raise RuntimeError(f"the CPU kernels do not take {store.dtype}")
        self.device, self.max_rows, self.hidden, self.max_polls = device, max_rows, store.hidden, max_polls
        H, P = store.hidden, max_rows * top_k
        elt = torch.empty((), dtype=store.dtype).element_size()
        ids_w = HEADER_WORDS
        marks_w = ids_w + _words(8 * P)
        weights_w = marks_w + _words(8 * P)
        x_w = weights_w + _words(4 * P)
        on_gpu = device.type == "cuda"
        # to_cpu: written by the device, read by the worker; to_gpu the other way round. Two
        # allocations, so that nothing ever copies one side's region over the other's writes.
        self.to_cpu = torch.zeros(x_w + _words(elt * max_rows * H), dtype=torch.int64, pin_memory=on_gpu)
        self.to_gpu = torch.zeros(HEADER_WORDS + _words(4 * max_rows * H), dtype=torch.int64, pin_memory=on_gpu)
        self.ids = self.to_cpu[ids_w:ids_w + P]  # (P,) the layer's routing
        self.marks = self.to_cpu[marks_w:marks_w + P]  # (P,) 1: the CPU computes the pair
        self.weights = self.to_cpu[weights_w:].view(torch.float32)[:P]  # (P,) routing weights
        self.x = self.to_cpu[x_w:].view(store.dtype)[:max_rows * H]  # (N·H,) the layer's input
        self.done = self.to_gpu[:1]  # the last post answered
        self.out = self.to_gpu[HEADER_WORDS:].view(torch.float32)[:max_rows * H].view(max_rows, H)  # (N, H) fp32
        # on the device: the split's three costs, the last post's number, the current layer's post (0:
        # none), the error flag (a wait that ran out of polls)
        self.split = torch.tensor([float(v) for v in split], dtype=torch.float32, device=device)
        self.seq = torch.zeros(1, dtype=torch.int64, device=device)
        self.expect = torch.zeros(1, dtype=torch.int64, device=device)
        self.error = torch.zeros(1, dtype=torch.int32, device=device)
        self.error_host = torch.zeros(1, dtype=torch.int32, pin_memory=on_gpu)
        self.split_values = tuple(float(v) for v in split)
        self.threads = threads or worker_threads()
        code = native.DTYPE_CODES
        if store.quantised:  # the worker reads the blocks: each expert's three addresses, each layer's types
            L, E = store.n_layers, store.n_experts
            rows = np.zeros((L, E, 0), dtype=np.int64)
            blocks, types = np.zeros((L, E, 3), dtype=np.int64), np.zeros((L, 3), dtype=np.int32)
            for layer in store.layers:
                blocks[layer] = store.quant_addresses(layer)
                types[layer] = [code for code, *_ in store.layouts[layer].parts]
            tables = dict(blocks=blocks, types=types)
        else:
            rows, tables = store.all_moe_rows(), {}
        self._worker = nat.CpuMailbox(self.to_cpu.data_ptr(), self.to_gpu.data_ptr(),
                                      [ids_w, marks_w, weights_w, x_w, HEADER_WORDS], max_rows, top_k, H,
                                      store.expert_ffn, code[store.dtype], code[store.dtype], rows,
                                      self.threads, **tables)

    # -- inside the graph -------------------------------------------------------------------------
    def post(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
             pool_numel: int, gpu_ids: torch.Tensor, log: torch.Tensor, cpu_log: torch.Tensor) -> torch.Tensor:
        """Split the layer's misses and post the CPU's part (device work only) → ids for the GPU
        kernels (N, k), -1 for the CPU's pairs. log, cpu_log (N·k,): the routing and the CPU marks."""
        return cpu_mailbox_gpu.post(x, ids, weights, offsets, pool_numel, layer, self, gpu_ids, log, cpu_log)

    @property
    def wait_args(self) -> tuple:
        """moe_decode's `cpu=`: the sum kernel waits for the answer and adds it."""
        return self.expect, self.done, self.out, self.error, self.max_polls

    # -- between replays --------------------------------------------------------------------------
    def set_split(self, split: tuple[float, float, float]) -> None:
        """(link_ms, cpu_ms, handoff_ms), queued on the current stream: replays after it split with
        these. Three fills carrying the values as kernel arguments, so the host neither waits for the
        replay in flight (a copy from pageable memory would synchronise the stream) nor keeps a staging
        buffer alive. (The mailbox is made inside the engine's inference mode; its tensors are written
        in place only inside one.)"""
        self.split_values = tuple(float(v) for v in split)
        with torch.inference_mode():
            for i, v in enumerate(self.split_values):
                self.split[i].fill_(v)

    def queue_check(self) -> None:
        """Queue the error flag's copy to the host behind the work launched so far."""
        self.error_host.copy_(self.error, non_blocking=True)

    def check(self) -> None:
        """Raise if a post failed on the CPU or a wait ran out of polls (after queue_check's copy landed)."""
        failed = self._worker.error() if self._worker is not None else ""
        if failed or int(self.error_host[0]):
            raise RuntimeError("the CPU's share of a decode step's experts failed"
                               + (f": {failed}" if failed else ": the worker did not answer in time")
                               + ". The step's output is wrong; restart generation (TANDEM_GRAPH_CPU=0 turns "
                               "the CPU share off).")

    def telemetry(self) -> dict:
        w = self._worker
        if w is None:  # closed: its last counts
            return self._final
        return {"threads": self.threads, "posts": w.answered, "experts": w.experts, "cpu_s": round(w.compute_s, 6)}

    def fit_sums(self) -> list[float]:
        """The worker's (posts, Σc, Σc², Σt, Σc·t) so far (MissSplit.observe)."""
        return self._worker.fit_sums() if self._worker is not None else [0.0] * 5

    def close(self) -> None:
        """Synchronise the device (no wait kernel may still read), stop the worker, keep the memory
        until the worker is gone."""
        if self._worker is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._final = self.telemetry()
        self._worker = None  # joins the worker's thread

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass
