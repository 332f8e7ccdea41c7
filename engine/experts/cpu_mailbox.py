"""CpuMailbox: the CPU computes part of each layer's misses inside the one decode graph.

The graph reads every miss over PCIe (engine/experts/zero_copy.py); where the cache is tight (32K
with one chat) that binds the step to the link while the CPU idles. Seed 004 sends part of the
misses to the CPU instead, sized so that both sides finish together. Between layers of a
graph there is no host call to split them, so the device splits them (`post`, in
engine/kernels/cpu_mailbox_gpu.py), hands the CPU's share over through pinned host memory, and the
native worker (native/cpu_mailbox.h) answers there; the layer's sum kernel waits for the answer. Over
a store of GGUF blocks the worker runs the quantised CPU set (native/quant_moe.h) on the blocks
where they lie in the store.

The mailbox's kernels are only in the graph of steps run while the gate (ChurnGate) is open:
engine/runtime/decode_graph.py captures the one graph twice, with them ("graph+cpu") and without
("graph"), and the step replays whichever the gate wants. Where the cache holds the working set (2K,
one chat) the gate stays shut and the step is the graph as it was before the mailbox.

This object owns the two pinned regions, the device's small scalars and the worker, and tears them
down in reverse order: the device is synchronised (no kernel waits on the worker), the worker thread
stops, then the memory goes.

The share of a layer's missed experts that go to the CPU is `share`: floor(share · misses) of them.
GRAPH_CPU_SHARE is the default; TANDEM_GRAPH_CPU_SHARE overrides it (0 turns the mailbox off: the
remedy a failed CPU share names).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from engine.kernels import cpu_mailbox_gpu, native

HEADER_WORDS = 16  # int64 words before the arrays: the sequence number's line, then layer and rows (to_cpu)
# Reads of host memory before a waiting sum kernel gives up and flags the step (about 1 µs each over
# PCIe: seconds; the interpreter's are slower, and its worker answers before the kernel even starts).
MAX_POLLS = 1 << 22


# Three quarters of a churning layer's misses go to the CPU: the native kernel reads a one-token expert
# at 70-80 GB/s from DRAM where the graph reads one over PCIe at ~35, so decode speed rises with the
# share up to here (at 32K, bs=1, 916 slots of an H200: 29.7 tok/s at 0, 38.2 at 0.31, 48.7 at 0.5,
# 53.5 at 0.75). The cost model's own rates (0.31 there) undervalue the native kernel.
GRAPH_CPU_SHARE = 0.75


def default_share() -> float:
    """The share of each layer's missed experts the CPU takes: TANDEM_GRAPH_CPU_SHARE, else GRAPH_CPU_SHARE."""
    env = os.environ.get("TANDEM_GRAPH_CPU_SHARE")
    if env is None:
        return GRAPH_CPU_SHARE
    share = float(env)
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"TANDEM_GRAPH_CPU_SHARE must lie in [0, 1] (got {env})")
    return share


# The share applies only while the cache churns (ChurnGate): more than this share of its slots missed
# per step. CPU experts never enter the cache, so where it still learns the link's fills are worth
# more. 8% lies between the two regimes (48 layers on an H200):
# - a warm cache at 2K, bs=1 misses 14-20 experts a step, under 1% of 2,267 slots: there the share
#   slows learning (hit rate 0.915 against 0.941, 97 against 105 tok/s), and a gate at 2.5% still
#   opens on a fresh cache's first steps;
# - 2K at bs=4 misses ~17% of the slots a step (the share: 81-89 tok/s against 37), 32K at bs=1 with
#   916 slots 13-14% (48-51 against 30).
CPU_CHURN_SHARE = 0.08


class ChurnGate:
    """The share of each layer's misses the CPU takes: `share` while the cache churns (more than
    CPU_CHURN_SHARE of its n_slots missed per step), else 0; `gated` False: always `share`. The
    measure is a moving average that starts at 0, so a fresh cache's first steps alone do not open
    the gate (else at 2K bs=1 the CPU takes ~300 experts that never enter the cache); a steady churn
    of 13-17% of the slots crosses 8% within 3-4 steps."""

    def __init__(self, share: float, n_slots: int, gated: bool = True):
        self.share, self.n_slots, self.gated = share, n_slots, gated
        self.missed_avg = 0.0  # missed experts per step

    def observe(self, n_missed: int) -> None:
        """A step's missed experts (read over PCIe and computed on the CPU alike)."""
        self.missed_avg = 0.75 * self.missed_avg + 0.25 * n_missed

    def current(self) -> float:
        churning = self.missed_avg > CPU_CHURN_SHARE * self.n_slots
        return self.share if churning or not self.gated else 0.0

    def telemetry(self) -> dict:
        return {"cpu_gated": self.gated, "missed_per_step": round(self.missed_avg, 1)}


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
    def __init__(self, store, device: torch.device, max_rows: int, top_k: int, share: float,
                 threads: int | None = None, max_polls: int = MAX_POLLS):
        """store: the ExpertStore the CPU computes from; max_rows: tokens a step carries; share: of
        each layer's missed experts, the part the CPU computes; threads: the worker's team
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
        # on the device: the share, the last post's number, the current layer's post (0: none), the
        # error flag (a wait that ran out of polls)
        self.share = torch.tensor([float(share)], dtype=torch.float32, device=device)
        self.seq = torch.zeros(1, dtype=torch.int64, device=device)
        self.expect = torch.zeros(1, dtype=torch.int64, device=device)
        self.error = torch.zeros(1, dtype=torch.int32, device=device)
        self.error_host = torch.zeros(1, dtype=torch.int32, pin_memory=on_gpu)
        self.share_value = float(share)
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
    def set_share(self, share: float) -> None:
        """Queued on the current stream: replays after it split with the new share. (The mailbox is
        made inside the engine's inference mode; its tensors are written in place only inside one.)"""
        with torch.inference_mode():
            self.share.fill_(float(share))
        self.share_value = float(share)

    def queue_check(self) -> None:
        """Queue the error flag's copy to the host behind the work launched so far."""
        self.error_host.copy_(self.error, non_blocking=True)

    def check(self) -> None:
        """Raise if a post failed on the CPU or a wait ran out of polls (after queue_check's copy landed)."""
        failed = self._worker.error() if self._worker is not None else ""
        if failed or int(self.error_host[0]):
            raise RuntimeError("the CPU's share of a decode step's experts failed"
                               + (f": {failed}" if failed else ": the worker did not answer in time")
                               + ". The step's output is wrong; restart generation (TANDEM_GRAPH_CPU_SHARE=0 turns "
                               "the CPU share off).")

    def telemetry(self) -> dict:
        w = self._worker
        if w is None:  # closed: its last counts
            return dict(self._final, share=self.share_value)
        return {"share": self.share_value, "threads": self.threads, "posts": w.answered, "experts": w.experts, "cpu_s": round(w.compute_s, 6)}

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
