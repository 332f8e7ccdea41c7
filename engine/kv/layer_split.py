"""One KV backend over two: the sliding-window layers' KV resident, the full layers' in a hybrid.

gpt-oss alternates 128-token sliding-window layers with full-attention layers. A window layer reads
at most `window` keys per query, so its KV is small to attend and never worth spilling; the full
layers' KV grows with the chat and is what a hybrid policy (writescope, gpu-centric, cpu-centric,
fixed, monolithic) splits between the GPU and the CPU. `LayerSplitKV` presents the KVBackend
interface to the model and sends each layer's attend to its part, with the layer's index among
that part's layers:

    window layers   ResidentKV: per-layer window and sinks (paged decode on CUDA, masked SDPA else)
    full layers     the hybrid backend: sinks merged once after all of its parts (kv/writescope.py)

Every sequence and step call goes to both parts, which keep the same lengths; a sequence's id is
the hybrid part's, mapped to the resident part's own.

The window layers' part is a ResidentKV of the whole context, not a ring of the last `window`
tokens: a ring could not be cropped back past its slack (a regenerate or an edit goes back a whole
reply), so every such crop would have to read the chat again from the start, as a recurrent state
must (kv/recurrent.py). Its bytes are those of n_window_layers / n_layers of the resident KV
(gpt-oss-20b: 12 of 24 layers, 24 KiB of a 48 KiB token); runtime/kv_setup.py and the planner
count them on the GPU.

Decode CUDA graphs: this object is not a ResidentKV, so runtime/decode_graph.py declines to
capture it (the hybrid part decides placement on the host every step) and steps run eagerly.
"""

from __future__ import annotations

import torch

from engine.kv.backend import KVBackend
from engine.kv.resident import ResidentKV


def binding_window(window: int | None, max_context: int) -> int | None:
    """The window if it hides any key within max_context tokens, else None (full attention)."""
    return window if window is not None and window < max_context else None


def split_windows(args, max_context: int) -> list[int | None] | None:
    """Per KV layer its binding window, when some layer has one; else None (one backend serves every
    layer: all full, or a model-wide window without per-layer ones, which only resident KV honours)."""
    if args.layer_windows is None:
        return None
    windows = [binding_window(args.layer_windows[i], max_context) for i in args.kv_layer_ids()]
    return windows if any(w is not None for w in windows) else None


class LayerSplitKV(KVBackend):
    supports_sinks = True  # and a window per layer: the window layers' part is resident
    supports_sliding_window = True

    def __init__(self, windows: list[int | None], max_context: int, resident: ResidentKV, hybrid: KVBackend):
        """windows: per KV layer (attend's `layer`), the model's window or None. A window shorter
        than max_context sends the layer to `resident` (built with one layer per such layer), the
        others (a window that never binds is full attention) to `hybrid`, in order."""
        self.windows = [binding_window(w, max_context) for w in windows]
        self.max_context = max_context
        self.resident, self.hybrid = resident, hybrid
        self.policy = hybrid.policy
        self.route: list[tuple[bool, int]] = []  # per layer: (resident?, its index in that part)
        n_res = n_hyb = 0
        for w in self.windows:
            if w is not None:
                self.route.append((True, n_res))
                n_res += 1
            else:
                self.route.append((False, n_hyb))
                n_hyb += 1
        self.n_resident_layers, self.n_hybrid_layers = n_res, n_hyb
        self._resident_id: dict[int, int] = {}  # hybrid's sequence id → resident's

    def __getattr__(self, name):  # calibrate, share, cache, transport …: the hybrid part's
        if name in ("hybrid", "resident"):
            raise AttributeError(name)
        return getattr(self.hybrid, name)

    # -- sequences ----------------------------------------------------------------------------------
    def new_sequence(self) -> int:
        sid = self.hybrid.new_sequence()
        try:
            self._resident_id[sid] = self.resident.new_sequence()
        except BaseException:
            self.hybrid.free(sid)
            raise
        return sid

    def free(self, seq_id: int) -> None:
        self.hybrid.free(seq_id)
        self.resident.free(self._resident_id.pop(seq_id))

    def crop(self, seq_id: int, n_tokens: int) -> None:
        self.hybrid.crop(seq_id, n_tokens)
        self.resident.crop(self._resident_id[seq_id], n_tokens)

    def length(self, seq_id: int) -> int:
        return self.hybrid.length(seq_id)

    def resume_point(self, seq_id: int, n_tokens: int) -> int:
        return min(self.hybrid.resume_point(seq_id, n_tokens),
                   self.resident.resume_point(self._resident_id[seq_id], n_tokens))

    # -- steps --------------------------------------------------------------------------------------
    def begin_step(self, seq_ids: list[int], n_new: int) -> torch.Tensor:
        """Both parts make room (the resident one first: it only checks the context and takes free
        blocks, which a failed hybrid begin gives back through the generator's crop)."""
        self.resident.begin_step([self._resident_id[s] for s in seq_ids], n_new)
        return self.hybrid.begin_step(seq_ids, n_new)  # (B, T) positions; the resident part's are equal

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None, window: int | None | str = "layer") -> torch.Tensor:
        """q (B, nh, T, hs); k, v (B, n_kv, T, hs) → (B, nh, T, hs). sinks (nh,) or None. window:
        the model's per-layer window, which must be this layer's as built ("layer": take it as built)."""
        resident, index = self.route[layer]
        own = self.windows[layer]
        if window != "layer" and binding_window(window, self.max_context) != own:
            raise ValueError(f"layer {layer} was built with window {own}, attended with {window}")
        options = {"sinks": sinks} if sinks is not None else {}
        if resident:
            return self.resident.attend(index, q, k, v, window=own, **options)
        return self.hybrid.attend(index, q, k, v, **options)

    def replayable_step(self) -> bool:
        return False  # the hybrid part places on the host every step

    def end_step(self) -> None:
        self.hybrid.end_step()
        self.resident.end_step()

    # -- stats and teardown ---------------------------------------------------------------------------
    def telemetry(self) -> dict:
        """The hybrid part's, with the window layers' resident bytes and tokens beside its regions."""
        tel = dict(self.hybrid.telemetry())
        res = self.resident.telemetry()
        tel["bytes"] = {**tel.get("bytes", {}), "kv_resident": res["bytes"]["kv_resident"]}
        tel["tokens"] = {**tel.get("tokens", {}), "resident": res["tokens"]["resident"]}
        tel["layers"] = {"resident": self.n_resident_layers, "hybrid": self.n_hybrid_layers}
        return tel

    def synchronize(self) -> None:
        if hasattr(self.hybrid, "synchronize"):
            self.hybrid.synchronize()
        if self.resident.device.type == "cuda":
            torch.cuda.synchronize(self.resident.device)

    def close(self) -> None:
        if hasattr(self.hybrid, "close"):
            self.hybrid.close()
