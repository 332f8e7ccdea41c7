"""What a suite cell is made of (engine/bench/suite.py runs them): the trees under test and the run's
context, a cell's registration, a fresh process of a tree's engine, the systems taking turns over the
rounds, and a row's statistics (medians, spreads, per-round ratios).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

PROBE = Path(__file__).with_name("suite_probe.py")


@dataclass
class Tree:
    """A source tree whose Tandem is measured: this checkout, or a worktree of another commit."""
    label: str
    path: Path
    commit: str
    dirty: int = 0  # files changed against the commit (this checkout only: others' work in progress)

    @property
    def name(self) -> str:
        # unique even for an A/B of HEAD against itself: this tree may carry uncommitted changes
        return f"tandem@{self.commit[:8]}" + (" (against)" if self.label == "against" else
                                               " + changes" if self.dirty else "")


@dataclass
class Ctx:
    trees: list[Tree]
    rounds: int = 3
    quick: bool = False
    work: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "tandem-bench-suite")
    routings: tuple = ("random", "zipf:1.0")
    threads: int | None = None
    llama_source: str | None = None
    tokenizer_from: str | None = None  # the GGUF exports' tokenizer (default: the built-in SmolLM2's)
    contexts: tuple | None = None  # the GPU decode cells' contexts, a subset of each cell's own (None: all)
    chats: tuple | None = None  # the GPU decode cells' chat counts, a subset of each cell's own (None: all)
    progress: Callable[[str], None] = lambda s: None

    def tandem_names(self) -> list[str]:
        return ["tandem"] if len(self.trees) == 1 else [t.name for t in self.trees]

    def tree_of(self, name: str) -> Tree:
        return self.trees[0] if name == "tandem" else next(t for t in self.trees if t.name == name)


class Skip(Exception):
    """A cell that cannot run here: the reason goes in the record and the table."""


# ---- running things ----------------------------------------------------------------------------

def env_for(tree: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def probe(tree: Path, spec: dict, timeout: float = 1800) -> dict:
    """One suite_probe.py measurement with `tree`'s engine (a fresh process)."""
    proc = subprocess.run([sys.executable, str(PROBE), json.dumps(spec)], cwd=tree, env=env_for(tree),
                          capture_output=True, text=True, timeout=timeout, check=False)
    lines = [x for x in proc.stdout.strip().splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"probe failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")
    return json.loads(lines[-1])


def tandem_cli(tree: Path, args: list[str], timeout: float = 1800) -> dict:
    """`tandem bench …` of `tree` (its own code), returning the JSON record it writes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        proc = subprocess.run([sys.executable, "-m", "engine.cli", *args, "--json", str(out)], cwd=tree,
                              env=env_for(tree), capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"tandem {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")
        return json.loads(out.read_text())


def alternate(ctx: Ctx, systems: dict[str, Callable[[], dict]]) -> dict[str, list[dict]]:
    """Each system once per round, the order reversed every other round → {system: [result per round]}."""
    out: dict[str, list[dict]] = {name: [] for name in systems}
    names = list(systems)
    for r in range(ctx.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            ctx.progress(f"round {r + 1}/{ctx.rounds}: {name}")
            out[name].append(systems[name]())
    return out


# ---- statistics and rows -----------------------------------------------------------------------

def stats(samples: list[float]) -> dict:
    xs = [x for x in samples if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "spread": None, "samples": samples}
    med = statistics.median(xs)
    return {"median": round(med, 3), "min": round(min(xs), 3), "max": round(max(xs), 3),
            # (max − min) / median: how far apart the rounds were
            "spread": round((max(xs) - min(xs)) / med, 3) if med else None, "samples": [round(x, 3) for x in xs]}


def ratio(a: list[float], b: list[float]) -> dict:
    """Median and list of the per-round ratios a/b (rounds where both were measured)."""
    per = [x / y for x, y in zip(a, b) if x is not None and y]
    return {"median": round(statistics.median(per), 3) if per else None, "per_round": [round(x, 3) for x in per]}


ROW_PREFIX = "[suite] row "  # a row as the progress log has it, then the row's JSON


def row(ctx: Ctx, metric: str, condition: str, samples: dict[str, list[float]], peer: str, peer_kind: str = "peer",
        **extra) -> dict:
    """One table row: every system's figures, each Tandem tree over the peer, and the A/B ratio."""
    out = {"metric": metric, "condition": condition, "peer": peer, "peer_kind": peer_kind,
           "systems": {name: stats(xs) for name, xs in samples.items()},
           "ratio": {name: ratio(samples[name], samples[peer]) for name in ctx.tandem_names()}, **extra}
    if len(ctx.trees) == 2:
        this, other = (t.name for t in ctx.trees)
        out["ab"] = {"this": this, "against": other, **ratio(samples[this], samples[other])}
    # the record is written when every cell has run: a run cut short (a lease's time out) keeps its rows
    # in the progress log, one JSON line each
    ctx.progress(ROW_PREFIX + json.dumps(out, default=str))
    return out


@dataclass
class Cell:
    id: str
    title: str
    needs: str  # "cpu" or "cuda"
    target: str
    run: Callable[[Ctx], list[dict]]
    routed: bool = False  # offloads experts: reported under every routing
    in_quick: bool = True  # a CPU cell --quick runs (not one that first makes a multi-GB model file)
