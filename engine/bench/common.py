"""What every benchmark record carries: machine, versions, date, the command line."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys

import psutil


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "logical_cores": psutil.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__}


def header() -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "tandem " + " ".join(sys.argv[1:]) if sys.argv and _is_cli(sys.argv[0])
            else " ".join(sys.argv), "machine": machine()}


def _is_cli(argv0: str) -> bool:
    """The `tandem` script, or `python -m engine.cli` (whose argv[0] is the module's file path)."""
    name = os.path.basename(argv0)
    return "tandem" in name or argv0.replace(os.sep, "/").endswith("engine/cli.py")


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write_json(records, path: str | None, echo: bool = True) -> None:
    text = json.dumps(records, indent=2)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    if echo:
        print(text)
