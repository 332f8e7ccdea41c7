"""A profile as a readable table (what `tandem calibrate` prints). Pure formatting of the dict."""

from __future__ import annotations


def _num(v, fmt="{:.1f}", none="—") -> str:
    return none if v is None else fmt.format(v)


def _size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n} B"


def _why(section: dict, key: str) -> str:
    return (section.get("unavailable") or {}).get(key, "not measured")


def share_at(A: float, B: float | None, delta_ms: float | None, tokens: int) -> float | None:
    """The roofline share r(L) = clamp(B/(A+B) + Δ/((A+B)·L)) — shown next to the costs it comes
    from; the engine's policy itself lives in sched/roofline.py."""
    if B is None or delta_ms is None or A + B <= 0:
        return None
    r = B / (A + B) + delta_ms * 1e6 / ((A + B) * tokens)
    return min(1.0, max(0.0, r))


def table(data: dict, shape_key: str | None = None) -> str:
    m = data["machine"]
    cpu, gpu, mem = m["cpu"], m["gpu"], m["memory"]
    isa = " ".join(k.upper() for k, v in cpu.get("isa", {}).items() if v) or "none reported"
    lines = [f"Tandem calibration — {data['mode']}, {data.get('duration_s', 0):.1f} s, {data['created_utc']}",
             f"  CPU      {cpu.get('model')} — {cpu.get('physical_cores')} cores / {cpu.get('logical_cores')} threads, "
             f"torch uses {cpu.get('torch_threads')}; {isa}; DRAM {mem['dram_total_bytes'] / 2**30:.1f} GiB"]
    if gpu.get("available"):
        pcie = (f"PCIe Gen{gpu['pcie_gen']} x{gpu['pcie_width']}" if gpu.get("pcie_gen")
                else f"PCIe link unknown ({_why(gpu, 'pcie_gen')})")
        lines.append(f"  GPU      {gpu['name']} — {gpu['vram_total_bytes'] / 2**30:.1f} GiB "
                     f"({gpu['vram_free_bytes'] / 2**30:.1f} free); {pcie}; driver {gpu.get('driver') or '?'}, "
                     f"CUDA {gpu.get('cuda_runtime')}")
    else:
        lines.append(f"  GPU      none — {_why(gpu, 'name')}")
    dram = data["memory"]
    lines.append(f"  DRAM     read {dram['read_GBps']:.1f} GB/s, copy {dram['copy_GBps']:.1f} GB/s "
                 f"({dram['threads']} threads, {_size(dram['array_bytes'])} arrays)")
    tr = data.get("transfer", {})
    if tr.get("h2d"):
        sizes = [p["bytes"] for p in tr["h2d"]["pinned"]]
        lines.append("  PCIe     GB/s by transfer size: " + "  ".join(f"{_size(s):>8}" for s in sizes))
        for d in ("h2d", "d2h"):
            for kind in ("pinned", "pageable", "strided"):
                lines.append(f"           {d.upper()} {kind:<9}" + "  ".join(f"{p['GBps']:8.1f}" for p in tr[d][kind]))
        fit = tr["h2d"].get("pinned_fit")
        if fit:
            lines.append(f"           H2D pinned fit: {_num(fit['latency_us'])} µs + bytes / {_num(fit['GBps'])} GB/s")
        pin = data.get("pinning", {})
        lines.append(f"  pinning  cudaHostRegister {_num(pin.get('register_ms_per_MB'), '{:.3f}')} ms/MB, "
                     f"pinned alloc {_num(pin.get('pin_alloc_ms_per_MB'), '{:.3f}')} ms/MB")
    else:
        lines.append(f"  PCIe     not measured — {_why(tr, 'h2d')}")
    busy = data.get("load_average") or {}
    if busy.get("before") is not None and busy["before"] > 0.5 * busy["usable_cores"] + 0.5:
        lines.append(f"  WARNING  the machine was busy (load average {busy['before']} → {busy['after']} on "
                     f"{busy['usable_cores']} cores): CPU costs are inflated; calibrate again when it is idle")
    keys = [shape_key] if shape_key else list(data.get("shapes", {}))
    for key in keys:
        lines.extend(_shape_lines(data["shapes"][key]))
    return "\n".join(lines)


def _shape_lines(entry: dict) -> list[str]:
    s, kv, ex = entry["shape"], entry["kv"], entry.get("experts", {})
    k = s["kv"]
    lines = [f"  model    {entry['model']} — {k['n_heads']} q heads, {k['n_kv_heads']}×{k['head_dim']} KV, {k['dtype']}"
             + (f"; experts {s['expert']['hidden']}×{s['expert']['ffn']}" if s.get("expert") else "; dense")
             + f" ({entry['mode']}, {entry['calibrated_utc']})",
             f"  KV       per KV token of one layer; CPU kernel {kv['cpu_kernel']} ({kv['threads']} threads), "
             f"GPU kernel {kv.get('gpu_kernel') or '—'}"]
    for batch, c in kv.get("by_batch", {}).items():
        lines.append(f"           batch {batch}: A {c['A_ns_per_token']:.2f} ns, B {_num(c.get('B_ns_per_token'), '{:.2f}')} ns, "
                     f"C_CPU {c['C_cpu_ms']:.3f} ms, C_GPU {_num(c.get('C_gpu_ms'), '{:.3f}')} ms, "
                     f"Δ {_num(c.get('delta_ms'), '{:+.3f}')} ms")
        shares = [(L, share_at(c["A_ns_per_token"], c.get("B_ns_per_token"), c.get("delta_ms"), int(batch) * L))
                  for L in (1024, 8192, 32768, 131072)]
        if shares[0][1] is not None:
            lines.append("             roofline CPU share r(L): " + ", ".join(f"L={L}: {r:.2f}" for L, r in shares))
    check = entry.get("split_check")
    if "split_check" in entry and check is None:
        lines.append(f"  r(L)     check not run — {_why(entry, 'split_check')}")
    if check:
        lines.append(f"  r(L)     fastest fixed share vs roofline prediction (batch {check['batch']}):")
        for row in check["rows"]:
            lines.append(f"           L={row['L']}: best r {row['r_best']:.1f} ({row['ms_best']:.2f} ms), predicted "
                         f"{row['r_predicted']:.2f} ({row['ms_at_predicted']:.2f} ms, "
                         f"{100 * row['slowdown_at_predicted']:+.1f}%), deviation {row['deviation']:.2f}")
    if ex.get("cpu_ms"):
        tokens = [p["tokens"] for p in ex["cpu_ms"]]
        lines.append(f"  experts  {_size(ex['bytes_per_expert'])} each; ms per expert by tokens: "
                     + " ".join(f"{t:>7}" for t in tokens))
        lines.append("           CPU " + " ".join(f"{p['ms']:7.3f}" for p in ex["cpu_ms"]))
        if ex.get("gpu_ms"):
            lines.append("           GPU " + " ".join(f"{p['ms']:7.3f}" for p in ex["gpu_ms"]))
        lines.append(f"           fill {_num(ex.get('fill_ms'), '{:.3f}')} ms; B_P {_num(ex.get('B_P_GBps'))} GB/s, "
                     f"B_H {_num(ex.get('B_H_GBps'))} GB/s, B_R = max(B_H − B_P, 0) {_num(ex.get('B_R_GBps'))} GB/s")
        conc = ex.get("concurrent")
        if conc:
            lines.append(f"           at the same time: B_P {_num(conc['B_P_GBps'])} GB/s, B_H {_num(conc['B_H_GBps'])} GB/s")
        elif conc is None:
            lines.append(f"           concurrency not measured — {_why(ex, 'concurrent')}")
    else:
        lines.append(f"  experts  not measured — {_why(ex, 'cpu_ms')}")
    return lines
