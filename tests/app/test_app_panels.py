"""The live panels show what StatsSnapshot carries: real values, and "n/a" with a reason for nulls."""

from gui_helpers import send_and_wait, set_chat

from PySide6.QtCore import QTimer
from PySide6.QtGui import QColor

from app.panels import LivePanels, fmt_bytes
from app.plots import Series, Sparkline, axis_number, nice_top
from engine.api import StatsSnapshot


def test_panels_show_the_engine_snapshot(qtbot, open_window, moe_engine):
    w = open_window()
    set_chat(w, greedy=True, max_new_tokens=6)
    result = send_and_wait(qtbot, w, "Say hi.")
    qtbot.waitUntil(lambda: w.dock.panels.last is not None and w.dock.panels.last["phase"] == "idle", timeout=5000)
    snap = w.dock.panels.last
    p = w.dock.panels
    assert snap == w.timeline.records[-1]  # the panels show the latest record of the session timeline
    # The CPU-only engine reports no VRAM, no r split, no expert cache, no PCIe: each says so, none shows 0.
    assert snap["vram"]["device_total"] is None
    assert p.vram_text.text() == "n/a — the model runs on cpu: no GPU memory in use"
    assert p.r_text.text().startswith("n/a — KV policy 'resident'")
    assert p.experts_text.text().startswith("n/a — expert policy 'resident'")
    assert p.pcie_text.text().startswith("n/a — no GPU")
    # What it does report is shown as reported.
    assert fmt_bytes(snap["host"]["rss"]) in p.host_text.text()
    assert f"resident {snap['kv']['tokens']['resident']:,}" in p.kv_text.text()
    assert snap["kv"]["tokens"]["resident"] >= result["prompt_tokens"]
    assert f"decode {snap['speed']['decode_tok_s']:.1f} tok/s" in p.speed_text.text()
    assert f"TTFT {snap['speed']['ttft_s']:.2f} s" in p.speed_text.text()
    assert "torch-sdpa" in p.kernel_text.text()
    assert p.r_plot.values("r_deployed")[-1] is None  # a gap in the plot, not a zero
    model = snap["model"]  # a CPU engine on ≥ 2 cores measures its thread count, and the panel says what it runs
    if model.get("cpu_threads_max"):
        assert f"CPU threads {model['cpu_threads_now']} of {model['cpu_threads_max']}" in p.kernel_text.text()


def test_thread_words_say_when_fewer_threads_ran_faster():
    from app.panels import thread_words

    assert thread_words({}) == ""  # fixed by the config, a GPU, or another backend
    assert thread_words({"cpu_threads_now": 2, "cpu_threads_max": 2}) == " · CPU threads 2 of 2"
    assert "cores busy with other programs" in thread_words({"cpu_threads_now": 1, "cpu_threads_max": 2})


def test_panels_draw_hybrid_values_when_the_snapshot_has_them(qtbot, moe_engine):
    """A snapshot as a GPU build reports it (same dataclass, GPU-side fields filled) is drawn as given."""
    base = moe_engine.stats().to_dict()
    gib = 2**30
    base["vram"].update(weights=2 * gib, expert_cache=3 * gib, kv_dwindow=gib // 4, kv_pingpong=gib // 8,
                        workspace=gib // 2, budget=8 * gib, device_total=16 * gib, device_used=6 * gib)
    base["kv"].update(r_target=0.4, r_deployed=0.35, A_ns_per_token=12.5, B_ns_per_token=20.0, delta_ms=0.3,
                      costs_from="measured at setup")
    base["experts"].update(hits=90, misses=10, fills=6, cpu_executed=4, evictions=2, prefetch_used=3,
                           prefetch_wasted=1, hit_rate=0.9,
                           zero_copy={"graph_steps": 40, "zero_copy_experts": 1200, "graph_fills": 1100,
                                      "cpu_experts": 900, "cpu_split": {"link_ms": 0.246, "cpu_ms": 0.11,
                                                                        "handoff_ms": 0.08, "cpu_measured": True}})
    base["pcie"].update(h2d_bytes=3 * gib, d2h_bytes=gib // 10, h2d_gbps=24.5, d2h_gbps=1.5)
    base["host"].update(expert_store=17 * gib, expert_store_types=["Q4_K", "Q6_K"])  # a Q4_K_M file's experts
    base["model"].update(device="cuda:0", weight_types=["Q4_K", "Q6_K", "Q8_0"])  # its dense layers' blocks too
    snap = StatsSnapshot(**base).to_dict()  # the engine's own record type: the fields must exist
    snap["t"] = 1.0
    panels = LivePanels()
    qtbot.addWidget(panels)
    panels.update_snapshot(snap)
    later = {**snap, "t": 2.0, "experts": {**snap["experts"], "fills": 16, "cpu_executed": 6}}
    panels.update_snapshot(later)
    assert "weights 2.00 GiB (Q4_K/Q6_K/Q8_0 blocks)" in panels.vram_text.text()
    assert "expert cache 3.00 GiB" in panels.vram_text.text() and "weights in" not in panels.host_text.text()
    assert "budget 8.00 GiB" in panels.vram_text.text() and "of 16.00 GiB" in panels.vram_text.text()
    assert [s.value for s in panels.vram_bar.segments][:2] == [2 * gib, 3 * gib]
    assert panels.vram_bar.scale() == 16 * gib and panels.vram_bar.budget == 8 * gib
    assert panels.r_text.text().startswith("r deployed 0.35 · target 0.40")
    assert panels.r_text.text().endswith("(start: measured at setup)")  # no profile: the backend timed itself
    assert panels.r_plot.values("r_deployed") == [0.35, 0.35]
    assert "hit rate 90.0%" in panels.experts_text.text()
    assert "fills 10.0/s" in panels.experts_text.text() and "CPU-executed 2.0/s" in panels.experts_text.text()
    assert panels.flow_plot.values("fills_per_s") == [None, 10.0]  # no rate from a single sample
    assert "one-graph steps 40 · read in place 1,200" in panels.counts_text.text()
    assert ("misses computed on the CPU 900 (an expert: link 0.246 ms, CPU 0.110 ms + 0.080 ms a post, measured)"
            in panels.counts_text.text())
    assert "expert store 17.00 GiB (Q4_K/Q6_K blocks)" in panels.host_text.text()
    assert "H2D 24.50 GB/s" in panels.pcie_text.text() and "D2H 1.50 GB/s" in panels.pcie_text.text()
    panels.update_snapshot({**later, "t": 3.0, "model": {**later["model"], "device": "cpu"}})  # the CPU holds them
    assert "weights in Q4_K/Q6_K/Q8_0 blocks" in panels.host_text.text()
    img = panels.grab()
    assert not img.isNull() and img.width() > 100


def test_panels_that_do_not_apply_fold_into_one_line(qtbot, open_window):
    w = open_window()
    set_chat(w, greedy=True, max_new_tokens=4)
    send_and_wait(qtbot, w, "Hi")
    qtbot.waitUntil(lambda: w.dock.panels.last is not None, timeout=5000)
    p = w.dock.panels
    for panel, text in ((p.vram, p.vram_text), (p.r, p.r_text), (p.experts, p.experts_text), (p.pcie, p.pcie_text)):
        assert panel.folded and not panel.isVisibleTo(p) and text.text().startswith("n/a — ")
        line = f"<b>{p.titles[panel]}</b>: {text.text().removeprefix('n/a — ')}"
        assert line in p.not_here_text.text().split("<br>")  # one line each: what it is, and why not here
    assert p.not_here.isVisibleTo(p)
    assert not p.speed.folded and p.speed_plot.isVisibleTo(p) and not p.memory.folded
    assert "n/a" not in p.host_text.text()  # what this engine does not keep is left out, not listed as n/a
    assert "weights in" not in p.host_text.text()  # a float32 engine holds no blocks
    assert p.not_here.sizeHint().height() < 0.25 * 720  # no longer a quarter of the window


def test_charts_have_axes_and_keep_the_last_minute(qtbot):
    chart = Sparkline([Series("v", QColor("red"), label="v")], unit="tok/s")
    for i, v in enumerate([3.0, 7.7, None, 5.0]):
        chart.add({"v": v}, t=1000.0 + i)
    assert chart.top() == 10.0 and nice_top(0.42) == 0.5 and nice_top(130) == 200
    chart.add({"v": None}, t=1000.0 + 59)  # idle for a minute: the reply is still on the chart
    assert chart.has_values() and len(chart.visible()) == 5
    chart.add({"v": None}, t=1000.0 + 70)
    assert not chart.has_values()  # an empty minute says so in words, not as a flat zero
    pct = Sparkline([Series("r", QColor("blue"))], y_max=1.0, percent=True)
    assert pct.y_label(0.5) == "50%" and axis_number(2500) == "2.5k"
    img = chart.grab()
    assert not img.isNull()


def test_a_long_prompt_shows_reading_progress(qtbot, open_window, moe_engine):
    w = open_window()
    w.chat_list.new_chat()
    set_chat(w, greedy=True, max_new_tokens=2)
    paste = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog near the river bank." for i in range(110))
    seen_card, seen_panel = [], []

    def look():  # what a person would see, several times a second while the reply is under way
        seen_card.extend(x.tag.text() for x in w.view.widgets if x.message.role == "assistant")
        p = w.dock.panels
        if p.reading_text.isVisibleTo(p):
            seen_panel.append((p.reading_text.text(), p.last["phase"]))

    timer = QTimer()
    timer.timeout.connect(look)
    timer.start(40)
    prompt = len(moe_engine.render([{"role": "user", "content": paste}]))
    assert prompt > 1500  # four prefill chunks: a few seconds here
    send_and_wait(qtbot, w, paste)
    timer.stop()
    readings = [t for t in seen_card if t.startswith("reading ")]
    assert readings, seen_card
    assert all(t.endswith(f" / {prompt:,} tokens…") for t in readings)
    assert any(f"/ {prompt:,}</b> tokens" in text and phase == "prefill" for text, phase in seen_panel)
    assert not w.dock.panels.reading_text.isVisibleTo(w.dock.panels)  # gone once the reply is done
