"""The live panels: what the engine's StatsSnapshot says, drawn as it changes.

Every number shown comes from a snapshot; a null says "n/a" with the reason the snapshot itself
gives (the model runs on the CPU, the KV policy keeps all KV on one device, the model is dense, …).
"""

from __future__ import annotations

from PySide6.QtGui import QColor
from PySide6.QtWidgets import QDockWidget, QGroupBox, QLabel, QScrollArea, QVBoxLayout, QWidget

from app.plan_words import plan_line
from app.plots import Segment, Series, Sparkline, StackedBar

VRAM_REGIONS = [("weights", "weights", "#4e79a7"), ("expert_cache", "expert cache", "#f28e2b"),
                ("kv_dwindow", "KV D-window", "#59a14f"), ("kv_pingpong", "KV ping-pong", "#76b7b2"),
                ("kv_resident", "KV resident", "#edc948"), ("workspace", "workspace", "#b07aa1")]


def fmt_bytes(b) -> str:
    if b is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b} B"


def fmt(v, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def _device(snap: dict) -> str:
    if is_remote(snap):
        return "a remote server"
    return (snap.get("model") or {}).get("device") or "?"


def profile_words(profile: str | None) -> str:
    """"calibrated (quick, 2026-12-01)" from the engine's "PATH (quick, 2026-12-01T…)": the file's place
    is in the exported stats; on screen it is noise."""
    if not profile:
        return "not calibrated"
    inside = profile.rsplit("(", 1)[1].rstrip(")") if "(" in profile else ""
    parts = [p.strip()[:10] if "T" in p and p.strip()[:4].isdigit() else p.strip() for p in inside.split(",") if p.strip()]
    return "calibrated" + (f" ({', '.join(parts)})" if parts else "")


def thread_words(model: dict) -> str:
    """"CPU threads 1 of 2 (a core is busy)" where the engine measures its thread count, else ""."""
    now, most = model.get("cpu_threads_now"), model.get("cpu_threads_max")
    if now is None or most is None:
        return ""
    return f" · CPU threads {now} of {most}" + (" (fewer ran faster: cores busy with other programs)" if now < most else "")


def is_remote(snap: dict) -> bool:
    """The model runs on another machine: only what this client measures is known here."""
    return (snap.get("model") or {}).get("backend") == "remote"


def why_no_vram(snap: dict) -> str | None:
    if snap["vram"].get("device_total") is not None:
        return None
    return f"n/a — the model runs on {_device(snap)}: no GPU memory in use"


def why_no_r(snap: dict) -> str | None:
    kv = snap["kv"]
    if kv.get("r_deployed") is not None or kv.get("r_target") is not None:
        return None
    return f"n/a — KV policy '{kv.get('policy')}' keeps all KV on {_device(snap)}; no CPU/GPU split"


def why_no_experts(snap: dict) -> str | None:
    ex = snap["experts"]
    if ex.get("hit_rate") is not None or ex.get("hits") is not None:
        return None
    if not (snap.get("model") or {}).get("experts"):
        return "n/a — dense model: no experts"
    return f"n/a — expert policy '{ex.get('policy')}': every expert stays on {_device(snap)}, no cache"


def why_no_pcie(snap: dict) -> str | None:
    pc = snap["pcie"]
    if any(pc.get(k) is not None for k in ("h2d_gbps", "d2h_gbps", "h2d_bytes", "d2h_bytes")):
        return None
    if _device(snap).startswith("cuda"):
        return "n/a — nothing crosses PCIe under the resident policies"
    return f"n/a — no GPU (the model runs on {_device(snap)})"


class Panel(QGroupBox):
    """One panel. `fold(why)`: a panel that does not apply here hides, and the "Not in use here" panel
    says in one line what it is and why (no empty charts, no columns of n/a); `fold(None)` shows it again."""

    def __init__(self, title: str, parent=None):
        super().__init__(title, parent)
        self.box = QVBoxLayout(self)
        self.box.setContentsMargins(8, 6, 8, 8)
        self.box.setSpacing(4)
        self.folded = False
        self.why: str | None = None

    def label(self) -> QLabel:
        lab = QLabel()
        lab.setWordWrap(True)
        self.box.addWidget(lab)
        return lab

    def fold(self, why: str | None) -> None:
        self.folded = why is not None
        self.why = why
        self.setVisible(not self.folded)


class LivePanels(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.setSpacing(6)

        self.speed = Panel("Speed")
        self.speed_text = self.speed.label()
        self.reading_text = self.speed.label()  # "reading 12,000 / 32,000 tokens" while a prompt is read
        self.reading_text.setObjectName("readingText")
        self.reading_text.hide()
        self.speed_plot = Sparkline([Series("decode_tok_s", QColor("#59a14f"), label="decode")], unit="tok/s")
        self.speed.box.addWidget(self.speed_plot)
        self.kernel_text = self.speed.label()
        self.kernel_text.setObjectName("panelNote")

        self.memory = Panel("Memory on this computer")
        self.host_text = self.memory.label()
        self.kv_text = self.memory.label()

        self.vram = Panel("GPU memory by region")
        self.vram_bar = StackedBar()
        self.vram.box.addWidget(self.vram_bar)
        self.vram_text = self.vram.label()

        self.r = Panel("CPU share of KV attention (r)")
        self.r_text = self.r.label()
        self.r_plot = Sparkline([Series("r_deployed", QColor("#e15759"), label="deployed"),
                                 Series("r_target", QColor("#4e79a7"), dashed=True, label="target")],
                                y_max=1.0, percent=True)
        self.r.box.addWidget(self.r_plot)

        self.experts = Panel("Expert cache")
        self.experts_text = self.experts.label()
        self.hit_plot = Sparkline([Series("hit_rate", QColor("#59a14f"), label="hit rate")], y_max=1.0, percent=True)
        self.experts.box.addWidget(self.hit_plot)
        self.flow_plot = Sparkline([Series("fills_per_s", QColor("#f28e2b"), label="fills"),
                                    Series("cpu_per_s", QColor("#b07aa1"), label="on CPU")], unit="/s")
        self.experts.box.addWidget(self.flow_plot)
        self.counts_text = self.experts.label()
        self.counts_text.setObjectName("panelNote")

        self.pcie = Panel("PCIe transfers")
        self.pcie_text = self.pcie.label()
        self.pcie_plot = Sparkline([Series("h2d_gbps", QColor("#4e79a7"), label="to GPU"),
                                    Series("d2h_gbps", QColor("#e15759"), label="to host")], unit="GB/s")
        self.pcie.box.addWidget(self.pcie_plot)

        self.not_here = Panel("Not in use on this machine")
        self.not_here_text = self.not_here.label()
        self.not_here_text.setObjectName("panelNote")
        self.not_here.hide()

        self.order = (self.speed, self.memory, self.vram, self.r, self.experts, self.pcie)
        for panel in (*self.order, self.not_here):
            lay.addWidget(panel)
        lay.addStretch(1)
        self.titles = {p: p.title() for p in self.order}
        self.last: dict | None = None
        self.samples = 0

    def update_snapshot(self, snap: dict) -> None:
        prev, self.last = self.last, snap
        remote = is_remote(snap)
        for panel, title in self.titles.items():  # every panel says when it describes a remote model
            panel.setTitle(f"{title} — remote" if remote else title)
        self.samples += 1
        self._vram(snap)
        self._memory(snap)
        self._r(snap)
        self._experts(snap, prev)
        self._pcie(snap)
        self._speed(snap)
        folded = [p for p in self.order if p.folded]
        self.not_here_text.setText("<br>".join(f"<b>{self.titles[p]}</b>: {p.why.removeprefix('n/a — ')}"
                                               for p in folded))
        self.not_here.setVisible(bool(folded))

    def set_reading(self, done: int | None, total: int | None = None) -> None:
        """The engine's progress through a long prompt (None: not reading one)."""
        if done is None:
            self.reading_text.hide()
            return
        self.reading_text.setText(f"reading the prompt: <b>{done:,} / {total:,}</b> tokens")
        self.reading_text.show()

    def _vram(self, s: dict) -> None:
        v = s["vram"]
        self.vram_bar.set_data([Segment(label, v.get(key), QColor(color)) for key, label, color in VRAM_REGIONS],
                               v.get("budget"), v.get("device_total"))
        why = why_no_vram(s)
        self.vram.fold(why)
        if why:
            self.vram_text.setText(why)
        else:
            parts = [f"<span style='color:{c}'>■</span> {label} {fmt_bytes(v.get(k))}" for k, label, c in VRAM_REGIONS]
            types = (s.get("model") or {}).get("weight_types")
            if types:  # a GGUF's weights kept as the file has them
                parts[0] += f" ({'/'.join(types)} blocks)"
            parts.append(f"budget {fmt_bytes(v.get('budget'))} · used {fmt_bytes(v.get('device_used'))} of "
                         f"{fmt_bytes(v.get('device_total'))}")
            self.vram_text.setText("<br>".join(parts))

    def _memory(self, s: dict) -> None:
        h = s["host"]
        parts = [f"Tandem uses {fmt_bytes(h.get('rss'))}"]
        parts += [f"{label} {fmt_bytes(h[key])}" for key, label in
                  (("kv_pinned", "KV pinned"), ("kv_unpinned", "KV unpinned"), ("expert_store", "expert store"))
                  if h.get(key) is not None]  # a region this engine does not keep is left out, not shown as n/a
        if h.get("expert_store") is not None and h.get("expert_store_types"):  # quantised as the file has them
            parts[-1] += f" ({'/'.join(h['expert_store_types'])} blocks)"
        model = s.get("model") or {}
        if model.get("device") == "cpu" and model.get("weight_types"):  # the weights in RAM as the file has them
            parts.append(f"weights in {'/'.join(model['weight_types'])} blocks")
        plan = (s.get("model") or {}).get("plan")
        line = plan_line(plan) if plan else ""
        self.host_text.setText("Host: " + " · ".join(parts) + (f"<br>Plan: {line}" if line else ""))
        t = (s["kv"].get("tokens") or {})
        known = [(key, name) for key, name in (("resident", "resident"), ("dwindow", "D-window"),
                                               ("pinned", "pinned"), ("unpinned", "unpinned")) if t.get(key) is not None]
        self.kv_text.setText("KV tokens: " + (" · ".join(f"{name} {t[key]:,}" for key, name in known) or "none yet"))

    def _r(self, s: dict) -> None:
        kv = s["kv"]
        self.r_plot.add({"r_deployed": kv.get("r_deployed"), "r_target": kv.get("r_target")}, s.get("t"))
        why = why_no_r(s)
        self.r.fold(why)
        self.r_text.setText(why or f"r deployed {fmt(kv.get('r_deployed'))} · target {fmt(kv.get('r_target'))} · "
                                   f"A {fmt(kv.get('A_ns_per_token'), '.1f', ' ns/tok')} · "
                                   f"B {fmt(kv.get('B_ns_per_token'), '.1f', ' ns/tok')} · "
                                   f"Δ {fmt(kv.get('delta_ms'), '.2f', ' ms')}"
                                   + (f" (start: {kv['costs_from']})" if kv.get("costs_from") else ""))

    def _experts(self, s: dict, prev: dict | None) -> None:
        ex = s["experts"]
        self.hit_plot.add({"hit_rate": ex.get("hit_rate")}, s.get("t"))
        rates = {}
        for key, out in (("fills", "fills_per_s"), ("cpu_executed", "cpu_per_s")):
            old = prev["experts"].get(key) if prev else None
            dt = (s.get("t") or 0) - ((prev or {}).get("t") or 0)
            rates[out] = (ex[key] - old) / dt if ex.get(key) is not None and old is not None and dt > 0 else None
        self.flow_plot.add(rates, s.get("t"))
        why = why_no_experts(s)
        self.experts.fold(why)
        self.experts_text.setText(why or f"hit rate {fmt(ex.get('hit_rate'), '.1%')} (windowed) · "
                                         f"fills {fmt(rates['fills_per_s'], '.1f', '/s')} · "
                                         f"CPU-executed {fmt(rates['cpu_per_s'], '.1f', '/s')}")
        counts = [f"{k.replace('_', ' ')} {fmt(ex.get(k), ',')}" for k in
                  ("hits", "misses", "fills", "cpu_executed", "evictions", "prefetch_used", "prefetch_wasted")]
        zc = ex.get("zero_copy") or {}
        if zc.get("graph_steps"):  # decoding as one graph: misses read in place over PCIe
            counts.append(f"one-graph steps {fmt(zc['graph_steps'], ',')} · read in place "
                          f"{fmt(zc.get('zero_copy_experts'), ',')}")
        split = zc.get("cpu_split")
        if split:  # what the one graph's split of each layer's misses weighs (ms an expert, ms a CPU post)
            counts.append(f"misses computed on the CPU {fmt(zc.get('cpu_experts'), ',')} (an expert: link "
                          f"{fmt(split.get('link_ms'), '.3f', ' ms')}, CPU {fmt(split.get('cpu_ms'), '.3f', ' ms')} "
                          f"+ {fmt(split.get('handoff_ms'), '.3f', ' ms')} a post"
                          f"{', measured' if split.get('cpu_measured') else ', modelled'})")
        self.counts_text.setText(" · ".join(counts))

    def _pcie(self, s: dict) -> None:
        pc = s["pcie"]
        self.pcie_plot.add({"h2d_gbps": pc.get("h2d_gbps"), "d2h_gbps": pc.get("d2h_gbps")}, s.get("t"))
        why = why_no_pcie(s)
        self.pcie.fold(why)
        self.pcie_text.setText(why or f"H2D {fmt(pc.get('h2d_gbps'), '.2f', ' GB/s')} · "
                                      f"D2H {fmt(pc.get('d2h_gbps'), '.2f', ' GB/s')} · moved "
                                      f"{fmt_bytes(pc.get('h2d_bytes'))} / {fmt_bytes(pc.get('d2h_bytes'))}")

    def _speed(self, s: dict) -> None:
        sp = s["speed"]
        phase = s.get("phase")
        # The decode rate while it runs; other phases add a gap, so the last minute's replies stay drawn.
        self.speed_plot.add({"decode_tok_s": sp.get("decode_tok_s") if phase == "decode" else None}, s.get("t"))
        last = sp.get("decode_tok_s")
        self.speed_plot.empty_text = (f"idle — last reply {last:.1f} tok/s" if last else "idle — no reply yet")
        if phase != "prefill":
            self.set_reading(None)
        which = "now" if phase not in (None, "idle") else "last reply"
        where = "<b>remote</b>, measured here (network included) · " if is_remote(s) else ""
        self.speed_text.setText(f"{where}phase <b>{phase}</b> · {which}: decode "
                                f"{fmt(sp.get('decode_tok_s'), '.1f', ' tok/s')} · prefill "
                                f"{fmt(sp.get('prefill_tok_s'), '.1f', ' tok/s')} · TTFT "
                                f"{fmt(sp.get('ttft_s'), '.2f', ' s')}")
        k = s.get("kernels") or {}
        m = s.get("model") or {}
        if is_remote(s):
            self.kernel_text.setText(f"remote server {m.get('remote_url')} · model {m.get('model')} · memory, KV and "
                                     "experts are the server's and not visible here")
            return
        self.kernel_text.setText(f"{m.get('device', '?')} · {m.get('dtype', '?')} · CPU attention "
                                 f"{k.get('cpu_attention') or 'n/a'} · CPU experts {k.get('cpu_experts') or 'n/a'}"
                                 f"{thread_words(m)} · {profile_words(s.get('profile'))}")


class PanelsDock(QDockWidget):
    def __init__(self, parent=None):
        super().__init__("Live engine panels", parent)
        self.setObjectName("panelsDock")
        self.panels = LivePanels()
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(self.panels)
        self.setWidget(scroll)
        self.setMinimumWidth(300)
