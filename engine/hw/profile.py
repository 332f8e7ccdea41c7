"""The machine profile on disk: versioned JSON, written atomically, trusted only on its machine.

Location: `<user data dir>/hw-profile.json` (platformdirs; `TANDEM_DATA_DIR` overrides the folder,
EngineConfig.profile_path the file). One file per machine holds the machine-wide measurements
(DRAM, PCIe, pinning) and a section per calibrated model shape (A/B/Δ, expert costs); calibrating
another shape on the same machine adds its section and keeps the others.

Writing goes to a temporary file in the same folder, is fsynced, then renamed over the old file,
so a calibration killed at any point leaves the previous profile whole. Loading checks the schema
and the machine fingerprint (CPU model, core counts, GPU, driver, torch version); a profile from
another machine or schema raises ProfileMismatchError, which says what differs.

Readers (the roofline r(L), the expert planner) use `MachineProfile.kv_costs(shape)` and
`.expert_costs(shape)`; a shape that was not calibrated is scaled from the nearest calibrated one
by bytes per token or per expert (both costs are bandwidth-bound) and says so in `source`.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from engine.errors import TandemError
from engine.hw.probe import FINGERPRINT_KEYS, fingerprint, probe
from engine.hw.shapes import ExpertShape, KVShape

log = logging.getLogger("tandem.hw")
SCHEMA = "tandem-hw-profile"
SCHEMA_VERSION = 1  # raise when a field changes meaning: older profiles are then rejected
PROFILE_FILE = "hw-profile.json"
DATA_DIR_ENV = "TANDEM_DATA_DIR"


class ProfileError(TandemError):
    """A profile file is unreadable, or lacks what a reader asks for."""


class ProfileMismatchError(ProfileError):
    """A profile belongs to another machine, software stack or schema version."""


def data_dir() -> Path:
    """Tandem's per-user data folder (TANDEM_DATA_DIR overrides the platform's default)."""
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env).expanduser() if env else Path(platformdirs.user_data_dir("tandem", appauthor=False))


def default_path() -> Path:
    return data_dir() / PROFILE_FILE


def resolve_path(path: str | os.PathLike | None) -> Path:
    return Path(path).expanduser() if path else default_path()


# -- writing ---------------------------------------------------------------------------------------

def write_atomic(path: Path, text: str) -> None:
    """Replace path's contents with text so that a reader sees either the old or the new file whole."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # owner-only, like the file (mkstemp: 0600)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def save(data: dict, path: str | os.PathLike | None = None) -> Path:
    """Write a fresh calibration; shape sections of a matching profile already there are kept."""
    target = resolve_path(path)
    merged = dict(data)
    try:
        old = read(target)
    except ProfileError:
        old = None  # absent, unreadable or another machine's: the new profile replaces it
    if old is not None:
        shapes = dict(old.get("shapes", {}))
        shapes.update(data.get("shapes", {}))
        merged["shapes"] = shapes
    try:
        write_atomic(target, json.dumps(merged, indent=1, sort_keys=False) + "\n")
    except OSError as e:  # disk full, read-only folder: the old file is untouched (the rename never happened)
        raise ProfileError(f"the calibration profile could not be saved to {target} ({e.strerror or e})",
                           "free some disk space or make the folder writable, then calibrate again; until "
                           "then the previous profile (if any) stays in use") from e
    return target


# -- reading ---------------------------------------------------------------------------------------

def _parse(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise ProfileError(f"the calibration profile {path} cannot be read ({e})",
                           "run `tandem calibrate` to measure this machine again") from e
    if not isinstance(data, dict):
        raise ProfileError(f"the calibration profile {path} is not a JSON object", "run `tandem calibrate`")
    return data


def check(data: dict, path: Path, current: dict | None = None) -> None:
    """Raise ProfileMismatchError unless data is this schema and this machine's profile."""
    if data.get("schema") != SCHEMA or data.get("schema_version") != SCHEMA_VERSION:
        raise ProfileMismatchError(
            f"the calibration profile {path} has schema {data.get('schema')!r} version "
            f"{data.get('schema_version')!r}; this Tandem reads {SCHEMA!r} version {SCHEMA_VERSION}",
            "run `tandem calibrate` to measure this machine with this version")
    current = current if current is not None else fingerprint(probe())
    theirs = data.get("fingerprint") or {}
    differs = [f"{k}: profile {theirs.get(k)!r}, this machine {current.get(k)!r}"
               for k in FINGERPRINT_KEYS if theirs.get(k) != current.get(k)]
    if differs:
        raise ProfileMismatchError(
            f"the calibration profile {path} was measured on another machine or software stack ({'; '.join(differs)})",
            "run `tandem calibrate` to measure this one (the old profile is replaced)")


def read(path: str | os.PathLike | None = None, current: dict | None = None) -> dict | None:
    """The checked profile dict at path (default location), None if there is none; raises
    ProfileError / ProfileMismatchError for an unreadable or foreign one."""
    target = resolve_path(path)
    try:
        data = _parse(target)
    except FileNotFoundError:
        return None
    check(data, target, current)
    return data


def load(path: str | os.PathLike | None = None, strict: bool = False) -> "MachineProfile | None":
    """The profile in use, or None. A foreign or unreadable profile is ignored with a logged warning
    (strict=True raises it instead)."""
    target = resolve_path(path)
    try:
        data = read(target)
    except ProfileError as e:
        if strict:
            raise
        log.warning("%s — %s", e.what, e.remedy)
        return None
    return None if data is None else MachineProfile(data, target)


# -- what readers ask for --------------------------------------------------------------------------

@dataclass(frozen=True)
class KVCosts:
    """Roofline inputs per KV token of one layer: r(L) = B/(A+B) + Δ/((A+B)·L), clamped to [0, 1].
    Unpacks as (A_ns_per_token, B_ns_per_token, delta_ms); B and Δ are None without a GPU."""

    A_ns_per_token: float
    B_ns_per_token: float | None
    delta_ms: float | None
    C_cpu_ms: float = 0.0
    C_gpu_ms: float | None = None
    batch: int = 1  # the batch size these were measured at
    source: str = "measured"  # or "scaled from <shape key>"

    def __iter__(self):
        return iter((self.A_ns_per_token, self.B_ns_per_token, self.delta_ms))


@dataclass(frozen=True)
class ExpertCosts:
    """Expert cost table for the miss planner (ms per expert application, by tokens per expert)
    and the bandwidths of the fill/CPU split (GB/s, GB = 10^9 bytes)."""

    bytes_per_expert: int
    cpu_ms_by_tokens: dict[int, float]
    gpu_ms_by_tokens: dict[int, float] | None
    fill_ms: float | None  # one expert over PCIe from pinned memory
    B_P_GBps: float | None
    B_H_GBps: float
    B_R_GBps: float | None  # max(B_H − B_P, 0)
    concurrent: dict | None = None  # B_P_GBps, B_H_GBps measured while both run
    source: str = "measured"

    def cpu_ms(self, tokens: int) -> float:
        return _interpolate(self.cpu_ms_by_tokens, tokens)

    def gpu_ms(self, tokens: int) -> float | None:
        return None if self.gpu_ms_by_tokens is None else _interpolate(self.gpu_ms_by_tokens, tokens)


def _interpolate(table: dict[int, float], x: float) -> float:
    """Linear in tokens between measured counts; past the largest, the last segment's slope goes on
    (a fixed cost plus a cost per token); below the smallest, the smallest count's cost."""
    xs = sorted(table)
    if x <= xs[0] or len(xs) == 1:
        return table[xs[0]] * (x / xs[0] if x > xs[0] else 1.0)
    i = min(bisect_left(xs, x), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return table[x0] + (table[x1] - table[x0]) * (x - x0) / (x1 - x0)


class MachineProfile:
    def __init__(self, data: dict, path: Path | None = None):
        self.data, self.path = data, path

    @property
    def name(self) -> str:
        """What StatsSnapshot shows: the file, the mode and when it was measured."""
        where = str(self.path) if self.path else "in memory"
        return f"{where} ({self.data.get('mode')}, {self.data.get('created_utc')})"

    def _shapes(self, part: str) -> list[tuple[dict, dict]]:
        """(shape dict of the part, section) for every calibrated shape that has the part measured."""
        out = []
        for entry in self.data.get("shapes", {}).values():
            shape = entry.get("shape", {}).get(part)
            section = entry.get({"kv": "kv", "expert": "experts"}[part])
            if shape and section and (section.get("by_batch") if part == "kv" else section.get("cpu_ms")):
                out.append((shape, section))
        return out

    def kv_costs(self, shape: KVShape, batch: int = 1) -> KVCosts:
        """A, B, Δ for `shape` at the measured batch size nearest `batch`."""
        candidates = self._shapes("kv")
        if not candidates:
            raise ProfileError("the calibration profile has no KV measurements", "run `tandem calibrate`")
        exact = [c for c in candidates if KVShape(**c[0]) == shape]
        ref_shape, section = exact[0] if exact else _nearest(candidates, shape, lambda s: KVShape(**s).bytes_per_token,
                                                            shape.bytes_per_token)
        ref = KVShape(**ref_shape)
        by_batch = {int(b): v for b, v in section["by_batch"].items()}
        b = min(by_batch, key=lambda x: (abs(x - batch), x))
        m = by_batch[b]
        k = shape.bytes_per_token / ref.bytes_per_token  # per-token costs scale with bytes read
        source = "measured" if exact else f"scaled from {ref.key}"
        B = None if m.get("B_ns_per_token") is None else m["B_ns_per_token"] * k
        return KVCosts(A_ns_per_token=m["A_ns_per_token"] * k, B_ns_per_token=B, delta_ms=m.get("delta_ms"),
                       C_cpu_ms=m["C_cpu_ms"], C_gpu_ms=m.get("C_gpu_ms"), batch=b, source=source)

    def expert_costs(self, shape: ExpertShape | None = None) -> ExpertCosts:
        """The expert cost table for `shape` (default: the first calibrated expert shape)."""
        candidates = self._shapes("expert")
        if not candidates:
            raise ProfileError("the calibration profile has no expert measurements",
                               "run `tandem calibrate --model <an MoE model>`")
        if shape is None:
            ref_shape, e = candidates[0]
            exact = True
        else:
            hits = [c for c in candidates if ExpertShape(**c[0]) == shape]
            exact = bool(hits)
            ref_shape, e = hits[0] if hits else _nearest(candidates, shape,
                                                         lambda s: ExpertShape(**s).bytes_per_expert,
                                                         shape.bytes_per_expert)
        ref = ExpertShape(**ref_shape)
        k = 1.0 if exact else shape.bytes_per_expert / ref.bytes_per_expert  # bytes and flops both ∝ H·I
        table = lambda pts: None if pts is None else {int(p["tokens"]): p["ms"] * k for p in pts}
        fill = None if e.get("fill_ms") is None else e["fill_ms"] * k
        return ExpertCosts(bytes_per_expert=shape.bytes_per_expert if shape else e["bytes_per_expert"],
                           cpu_ms_by_tokens=table(e["cpu_ms"]), gpu_ms_by_tokens=table(e.get("gpu_ms")),
                           fill_ms=fill, B_P_GBps=e.get("B_P_GBps"), B_H_GBps=e["B_H_GBps"],
                           B_R_GBps=e.get("B_R_GBps"), concurrent=e.get("concurrent"),
                           source="measured" if exact else f"scaled from {ref.key}")

    def to_dict(self) -> dict:
        return self.data


def _nearest(candidates, shape, size_of, size):
    """The calibrated shape closest in bytes, preferring the same dtype (kernels differ per dtype)."""
    same = [c for c in candidates if c[0]["dtype"] == shape.dtype] or candidates
    return min(same, key=lambda c: abs(size_of(c[0]) - size) / max(size, 1))


__all__ = ["ExpertCosts", "KVCosts", "MachineProfile", "ProfileError", "ProfileMismatchError",
           "data_dir", "default_path", "load", "read", "save", "write_atomic"]
