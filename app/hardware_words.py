"""The engine's hardware probe and calibration profile as a person reads them.

`engine.api.probe_hardware()` and the profile are dicts of exact keys and bytes (right for tools and
for the wizard's Details); the wizard's first lines say the same in words: "NVIDIA RTX 4090 · 24 GB",
"64 GB RAM", "16 cores, AVX-512", and a missing GPU once, with what it means. Every number here is one
the engine reported; nothing is guessed.
"""

from __future__ import annotations

GB = 2**30  # memory sizes as people and vendors name them ("24 GB" for 24 GiB of VRAM)

ISA_NAMES = (("amx", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512", "AVX-512"), ("avx2", "AVX2"))


def gb(n: int | float | None) -> str:
    if n is None:
        return "?"
    v = n / GB
    return f"{v:.0f} GB" if v >= 10 else f"{v:.1f} GB".replace(".0 GB", " GB")


def gpu_line(probe: dict) -> str:
    gpu = probe.get("gpu") or {}
    if not gpu.get("name"):
        return "No usable GPU"
    parts = [gpu["name"], gb(gpu.get("vram_total_bytes"))]
    if gpu.get("pcie_gen") and gpu.get("pcie_width"):
        parts.append(f"PCIe {gpu['pcie_gen']}.0 ×{gpu['pcie_width']}")
    return " · ".join(parts)


def no_gpu_reason(probe: dict) -> str | None:
    """Why there is no GPU, in one sentence, and what it means (None when there is one)."""
    gpu = probe.get("gpu") or {}
    if gpu.get("name"):
        return None
    why = (gpu.get("unavailable") or {}).get("name") or "no CUDA device was found"
    if "no CUDA support" in why:
        cause = "this PyTorch build has no CUDA support"
    elif "NVML reports" in why:
        cause = "an NVIDIA GPU is present (" + why.split("NVML reports", 1)[1].strip() + ") but PyTorch cannot use it"
    else:
        cause = "PyTorch sees no CUDA device"
    return (f"{cause[0].upper()}{cause[1:]}, so the model runs on the CPU alone: slower, but everything works. "
            "The GPU memory budget and the GPU panels do not apply.")


def ram_line(probe: dict) -> str:
    mem = probe.get("memory") or {}
    total, free = mem.get("dram_total_bytes"), mem.get("dram_available_bytes")
    if total is None:
        return "RAM size not reported"
    return f"{gb(total)} RAM" + (f" ({gb(free)} free)" if free is not None else "")


def best_isa(isa: dict | None) -> str | None:
    return next((name for key, name in ISA_NAMES if (isa or {}).get(key)), None)


def cpu_line(probe: dict) -> str:
    cpu = probe.get("cpu") or {}
    cores = cpu.get("physical_cores") or cpu.get("logical_cores")
    text = f"{cores} core{'s' if cores != 1 else ''}" if cores else "CPU cores not reported"
    logical = cpu.get("logical_cores")
    if logical and cores and logical != cores:
        text += f" ({logical} threads)"
    usable = cpu.get("usable_cores")
    if usable and logical and usable < logical:
        text += f", {usable} usable here"
    isa = best_isa(cpu.get("isa"))
    if isa:
        text += f", {isa}"
    return text


def cpu_name(probe: dict) -> str:
    return (probe.get("cpu") or {}).get("model") or "CPU"


def software_line(probe: dict) -> str:
    sw = probe.get("software") or {}
    torch = (sw.get("torch") or "?").split("+")[0]
    return f"PyTorch {torch} · Python {sw.get('python', '?')}"


def machine_rows(probe: dict) -> list[tuple[str, str]]:
    """(label, words) rows for the hardware page: GPU, memory, CPU, software."""
    return [("GPU", gpu_line(probe)), ("Memory", ram_line(probe)),
            ("CPU", f"{cpu_name(probe)} · {cpu_line(probe)}"), ("Software", software_line(probe))]


def profile_line(profile: dict | None, saved: bool = True) -> str:
    """One line from a calibration profile: "PCIe 25 GB/s · RAM 60 GB/s · saved"."""
    if not profile:
        return "Not calibrated yet"
    parts = []
    h2d = ((profile.get("transfer") or {}).get("h2d") or {})
    fit = (h2d.get("pinned_fit") or {}).get("GBps") if isinstance(h2d, dict) else None
    if fit is None and isinstance(h2d, dict) and h2d.get("pinned"):
        fit = max(p.get("GBps") or 0 for p in h2d["pinned"]) or None
    parts.append(f"PCIe {fit:.0f} GB/s" if fit else "CPU only")
    ram = (profile.get("memory") or {}).get("read_GBps")
    if ram:
        parts.append(f"RAM {ram:.0f} GB/s")
    when = (profile.get("created_utc") or "")[:10]
    mode = profile.get("mode")
    parts.append(("saved" if saved else "in use") + (f" {when}" if when else "") + (f" ({mode})" if mode else ""))
    return " · ".join(parts)
