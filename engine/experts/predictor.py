"""Next-layer expert prediction and the hot-expert table.

`GateLookahead` predicts layer l+1's experts by applying layer l+1's router to layer l's MoE input
(the gate-based method PDScope §2.3 starts from: adjacent layers' hidden states are similar, so the
next gate applied early mostly picks what it will pick). The prediction is computed on the device
next to the real routing and travels to the host with it (no extra sync), drives prefetch one
layer ahead, and is scored when layer l+1 routes for real:

- `token_accuracy`: mean over tokens of |predicted top-k ∩ actual top-k| / k;
- `set_recall`: |∪ predicted ∩ ∪ actual| / |∪ actual| per layer step — the share of the experts a
  layer needs that a prefetch could have brought;
- `set_precision`: the share of predicted experts the layer really used (the prefetch hit rate).

`HotTable` counts tokens per (layer, expert) from traces; its top entries warm the cache at load
(PDScope's hot-expert table; `static` placement keeps exactly them).
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


class GateLookahead:
    def __init__(self, routers: dict[int, torch.Tensor], route, top_k: int, window: int = 256):
        """routers: MoE layer → router weight (E, H); route(logits, k) → (weights, ids)."""
        self.routers, self.route, self.top_k = dict(routers), route, top_k
        layers = sorted(self.routers)
        self.next_of = {a: b for a, b in zip(layers, layers[1:])}
        self.pending: dict[int, np.ndarray] = {}  # layer → predicted ids (N, k) awaiting its routing
        self._scores: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.totals = np.zeros(3)  # sums of token_accuracy, set_recall, set_precision
        self.scored = 0
        self._window_precision = 0.0  # Σ set_precision over the window

    def propose(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """x: (N, H) layer l's MoE input → predicted ids (N, k) of layer l+1, on x's device."""
        nxt = self.next_of.get(layer)
        if nxt is None:
            return None
        _, ids = self.route(F.linear(x, self.routers[nxt]), self.top_k)
        return ids

    def remember(self, layer: int, predicted: np.ndarray | None) -> None:
        nxt = self.next_of.get(layer)
        if nxt is not None and predicted is not None:
            self.pending[nxt] = predicted

    def score(self, layer: int, actual: np.ndarray) -> None:
        """Compare the prediction made for this layer (if any) with its real routing (N, k)."""
        pred = self.pending.pop(layer, None)
        if pred is None or pred.shape != actual.shape:
            return
        token_accuracy = (pred[:, :, None] == actual[:, None, :]).any(-1).sum() / actual.size  # mean over tokens of hits / k
        p, a = np.unique(pred), np.unique(actual)
        common = np.intersect1d(p, a, assume_unique=True).size
        s = (float(token_accuracy), common / a.size, common / p.size)
        if len(self._scores) == self._scores.maxlen:
            self._window_precision -= self._scores[0][2]  # the score the append below pushes out
        self._scores.append(s)
        self._window_precision += s[2]
        self.totals += s
        self.scored += 1

    def hit_rate(self) -> float | None:
        """Windowed set precision: the chance that a prefetched expert is used (kept as a running sum:
        it is read on every layer step)."""
        if not self._scores:
            return None
        return self._window_precision / len(self._scores)

    def accuracy(self) -> dict:
        """Mean scores since load (None before the first scored layer)."""
        if not self.scored:
            return {"token_accuracy": None, "set_recall": None, "set_precision": None, "scored_layers": 0}
        t = self.totals / self.scored
        return {"token_accuracy": float(t[0]), "set_recall": float(t[1]), "set_precision": float(t[2]),
                "scored_layers": self.scored}

    def reset(self) -> None:
        self.pending.clear()
        self._scores.clear()
        self.totals[:] = 0
        self.scored = 0
        self._window_precision = 0.0


class HotTable:
    """Tokens routed to each (layer, expert), accumulated from traces."""

    def __init__(self, n_layers: int, n_experts: int, counts: np.ndarray | None = None):
        self.counts = np.zeros((n_layers, n_experts), dtype=np.int64) if counts is None else \
            np.asarray(counts, dtype=np.int64).reshape(n_layers, n_experts)

    def add(self, layer: int, tokens_per_expert: np.ndarray) -> None:
        self.counts[layer] += tokens_per_expert

    def top(self, n: int) -> list[tuple[int, int]]:
        """The n most used (layer, expert) pairs, most used first (ties: lower layer, lower expert)."""
        flat = self.counts.ravel()
        used = np.flatnonzero(flat)
        order = used[np.lexsort((used, -flat[used]))][:max(0, n)]
        return [(int(i // self.counts.shape[1]), int(i % self.counts.shape[1])) for i in order]

    def to_json(self, model: str | None = None) -> str:
        return json.dumps({"model": model, "n_layers": self.counts.shape[0], "n_experts": self.counts.shape[1],
                           "counts": self.counts.tolist()})

    @classmethod
    def from_json(cls, text: str) -> "HotTable":
        d = json.loads(text)
        return cls(d["n_layers"], d["n_experts"], np.array(d["counts"]))

    def save(self, path: str | Path, model: str | None = None) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(path, "w", encoding="utf-8", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            f.write(self.to_json(model))  # owner-only, like every file Tandem writes for the user

    @classmethod
    def load(cls, path: str | Path) -> "HotTable":
        return cls.from_json(Path(path).read_text())


def even_spread(moe_layers: list[int], n_experts: int, n: int) -> list[tuple[int, int]]:
    """Without a recorded trace: n (layer, expert) pairs spread evenly, expert by expert across
    all layers, so every layer gets the same share of the cache."""
    out = []
    for e in range(n_experts):
        for layer in moe_layers:
            if len(out) >= n:
                return out
            out.append((layer, e))
    return out


def default_hot_table_path(model: str) -> Path:
    """Where `tandem bench trace` keeps the hot table of a model (per user)."""
    import platformdirs

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
    return Path(platformdirs.user_data_dir("tandem")) / "hot-experts" / f"{safe}.json"
