"""What the machine is: GPU (via torch and nvidia-ml-py), CPU, memory, software versions.

`probe()` never raises for missing hardware or libraries: a field it cannot read is None and its
section's `unavailable` dict says why. Nothing here measures speed (that is calibrate.py).
"""

from __future__ import annotations

import platform
from pathlib import Path

import psutil
import torch

# Instruction-set extensions the CPU kernels care about, as Linux names them in /proc/cpuinfo.
ISA_FLAGS = {
    "avx2": ("avx2",),
    "avx512": ("avx512f",),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}


def mark_unavailable(section: dict, field: str, reason: str) -> None:
    """Set section[field] = None and record why (the convention of every hw dict)."""
    section[field] = None
    section.setdefault("unavailable", {})[field] = reason


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it is not readable)."""
    return set(_read_cpuinfo().get("flags", "").split())


def _read_cpuinfo() -> dict[str, str]:
    """The first processor block of /proc/cpuinfo as key → value ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if info:
                break
            continue
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return info


def _cache_bytes(level: int) -> int | None:
    """Size of the CPU's cache at `level` (shared L3: the working-set bound for calibration)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    if not base.is_dir():
        return None
    for index in sorted(base.glob("index*")):
        try:
            if int((index / "level").read_text()) != level:
                continue
            size = (index / "size").read_text().strip().upper()  # "32768K"
        except (OSError, ValueError):
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return None


def probe_cpu() -> dict:
    cpu: dict = {}
    info = _read_cpuinfo()
    model = info.get("model name") or info.get("Model") or platform.processor() or None
    if model:
        cpu["model"] = model
    else:
        mark_unavailable(cpu, "model", "neither /proc/cpuinfo nor the platform names the CPU")
    cpu["logical_cores"] = psutil.cpu_count(logical=True)
    physical = psutil.cpu_count(logical=False)
    if physical:
        cpu["physical_cores"] = physical
    else:
        mark_unavailable(cpu, "physical_cores", "psutil cannot count physical cores on this system")
    try:
        cpu["usable_cores"] = len(psutil.Process().cpu_affinity())  # a container may see fewer
    except (AttributeError, psutil.Error):
        cpu["usable_cores"] = cpu["logical_cores"]
    cpu["torch_threads"] = torch.get_num_threads()
    flags = set(info.get("flags", "").split())
    isa: dict = {}
    if flags:
        for name, needed in ISA_FLAGS.items():
            isa[name] = all(f in flags for f in needed)
    else:  # no /proc/cpuinfo: torch knows the widest vector unit it dispatches to
        capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", …
        isa["avx2"] = capability in ("AVX2", "AVX512")
        isa["avx512"] = capability == "AVX512"
        for name in ("avx512_bf16", "amx"):
            mark_unavailable(isa, name, "no /proc/cpuinfo flags on this system")
    cpu["isa"] = isa
    cpu["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    l3 = _cache_bytes(3)
    if l3:
        cpu["l3_bytes"] = l3
    else:
        mark_unavailable(cpu, "l3_bytes", "the cache sizes are not readable from /sys on this system")
    return cpu


def probe_memory() -> dict:
    vm = psutil.virtual_memory()
    return {"dram_total_bytes": vm.total, "dram_available_bytes": vm.available}


def _nvml_gpu(index: int) -> tuple[dict, str | None]:
    """PCIe link and driver facts from NVML for GPU `index`, or ({}, reason)."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError as e:
        return {}, f"nvidia-ml-py is not installed ({e})"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, …
        return {}, f"NVML could not start ({type(e).__name__}: {e})"
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        out = {"driver": _text(pynvml.nvmlSystemGetDriverVersion()),
               "nvml_name": _text(pynvml.nvmlDeviceGetName(h))}
        for key, call in (("pcie_gen", pynvml.nvmlDeviceGetCurrPcieLinkGeneration),
                          ("pcie_width", pynvml.nvmlDeviceGetCurrPcieLinkWidth),
                          ("pcie_gen_max", pynvml.nvmlDeviceGetMaxPcieLinkGeneration),
                          ("pcie_width_max", pynvml.nvmlDeviceGetMaxPcieLinkWidth)):
            try:
                out[key] = int(call(h))
            except Exception as e:  # e.g. NVMLError_NotSupported on some boards
                out[key] = e
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        out["nvml_vram_total_bytes"], out["nvml_vram_free_bytes"] = int(mem.total), int(mem.free)
        return out, None
    except Exception as e:
        return {}, f"NVML could not read GPU {index} ({type(e).__name__}: {e})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def probe_gpu(index: int | None = None) -> dict:
    """The GPU torch would compute on (default: the current device): name, VRAM, PCIe link, driver.
    Every key is always present."""
    gpu: dict = {"cuda_runtime": torch.version.cuda}
    if torch.version.cuda is None:
        gpu["cuda_runtime"] = None
        gpu.setdefault("unavailable", {})["cuda_runtime"] = "this torch build has no CUDA support"
    cuda = torch.cuda.is_available()
    gpu["available"] = cuda
    if index is None:
        index = torch.cuda.current_device() if cuda else 0
    if cuda:
        free, total = torch.cuda.mem_get_info(index)
        major, minor = torch.cuda.get_device_capability(index)
        gpu.update(name=torch.cuda.get_device_name(index), vram_total_bytes=int(total),
                   vram_free_bytes=int(free), compute_capability=f"{major}.{minor}")
    nvml, why_not = _nvml_gpu(index)
    if not cuda:
        reason = ("this torch build has no CUDA support" if torch.version.cuda is None
                  else "torch sees no CUDA device (torch.cuda.is_available() is False)")
        for key in ("name", "vram_total_bytes", "vram_free_bytes", "compute_capability"):
            mark_unavailable(gpu, key, reason)
        if nvml.get("nvml_name"):  # a GPU exists but torch cannot use it: say so
            gpu["unavailable"]["name"] = f"{reason}; NVML reports {nvml['nvml_name']}"
    for key in ("pcie_gen", "pcie_width", "pcie_gen_max", "pcie_width_max", "driver"):
        value = nvml.get(key)
        if isinstance(value, Exception):
            mark_unavailable(gpu, key, f"NVML: {type(value).__name__}")
        elif value is None:
            mark_unavailable(gpu, key, why_not or "NVML did not report it")
        else:
            gpu[key] = value
    return gpu


def probe_software() -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(), "os": platform.platform()}


def probe() -> dict:
    """Everything the machine reports about itself, as a JSON-serialisable dict."""
    return {"cpu": probe_cpu(), "memory": probe_memory(), "gpu": probe_gpu(), "software": probe_software()}


FINGERPRINT_KEYS = ("cpu_model", "logical_cores", "physical_cores", "gpu_name", "driver", "torch")


def fingerprint(machine: dict) -> dict:
    """The facts a profile must share with the machine to be trusted on it (FINGERPRINT_KEYS)."""
    cpu, gpu, sw = machine["cpu"], machine["gpu"], machine["software"]
    fp = {"cpu_model": cpu.get("model"), "logical_cores": cpu.get("logical_cores"),
          "physical_cores": cpu.get("physical_cores"), "gpu_name": gpu.get("name"),
          "driver": gpu.get("driver"), "torch": sw.get("torch")}
    sources = {"cpu_model": (cpu, "model"), "physical_cores": (cpu, "physical_cores"),
               "gpu_name": (gpu, "name"), "driver": (gpu, "driver")}
    for key, (section, field) in sources.items():
        if fp[key] is None:
            mark_unavailable(fp, key, (section.get("unavailable") or {}).get(field, "not reported"))
    return fp
