"""Decode tokens/s against context, one line per system, from benchmark records → PNG.

    QT_QPA_PLATFORM=offscreen python3 benchmarks/plot.py benchmarks/h200/2026-11-29-F out.png

Reads the `tandem bench e2e` records (`tandem-*.json`, one line per (policy, bs)) and the llama-bench
records (`llamacpp-*.json`, one line each) in a folder. Drawn with QPainter (PySide6 is already a
dependency; no plotting library needed): log-scale y, one x tick per measured context.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QGuiApplication, QImage, QPainter, QPen

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f"]


def series_from(folder: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for f in sorted(folder.glob("llamacpp-*.json")):
        rec = json.loads(f.read_text())
        name = "llama.cpp " + (rec.get("note") or f.stem).split(" (")[0]  # the note minus its aside
        for row in rec.get("results", []):
            if str(row.get("test", "")).startswith("tg"):
                out.setdefault(name, {})[int(row["n_depth"])] = float(row["tok_s"])
    for f in sorted(folder.glob("tandem-*.json")):
        rec = json.loads(f.read_text())
        budget = f"{rec['vram_budget_gb']:g} GB" if rec.get("vram_budget_gb") else "all VRAM"
        for row in rec["results"]:
            name = f"Tandem {row['kv_policy']}+{row['expert_policy']} bs={row['bs']} ({budget})"
            out.setdefault(name, {})[int(row["context"])] = float(row["decode_tok_s"])
    return out


def render(series: dict[str, dict[int, float]], path: Path, title: str) -> None:
    W, H, left, right, top, bottom = 1100, 620, 80, 430, 50, 60
    img = QImage(W, H, QImage.Format_ARGB32)
    img.fill(QColor("white"))
    p = QPainter(img)
    p.setRenderHint(QPainter.Antialiasing)
    p.setFont(QFont("DejaVu Sans", 10))
    xs = sorted({x for s in series.values() for x in s})
    ys = [y for s in series.values() for y in s.values() if y > 0]
    lo, hi = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    plot = QRectF(left, top, W - left - right, H - top - bottom)

    def X(x):  # even spacing per measured context (contexts grow 4× per step)
        return plot.left() + plot.width() * (xs.index(x) + 0.5) / len(xs)

    def Y(y):
        return plot.bottom() - plot.height() * (math.log10(y) - lo) / (hi - lo)

    p.setPen(QPen(QColor("#888")))
    p.drawRect(plot)
    for e in range(lo, hi + 1):
        p.drawLine(QPointF(plot.left(), Y(10 ** e)), QPointF(plot.right(), Y(10 ** e)))
        p.drawText(QRectF(0, Y(10 ** e) - 8, left - 8, 16), Qt.AlignRight | Qt.AlignVCenter, f"{10 ** e:g}")
    for x in xs:
        p.drawText(QRectF(X(x) - 40, plot.bottom() + 6, 80, 16), Qt.AlignCenter, f"{x // 1024}K")
    p.setPen(QPen(QColor("black")))
    p.drawText(QRectF(0, 10, W - right, 24), Qt.AlignCenter, title)
    p.drawText(QRectF(plot.left(), H - 28, plot.width(), 20), Qt.AlignCenter, "context (tokens in the KV cache)")
    p.save()
    p.translate(18, plot.center().y())
    p.rotate(-90)
    p.drawText(QRectF(-120, -10, 240, 20), Qt.AlignCenter, "decode tokens/s (log)")
    p.restore()
    for i, (name, pts) in enumerate(series.items()):
        color = QColor(COLORS[i % len(COLORS)])
        p.setPen(QPen(color, 2.2, Qt.DashLine if name.startswith("llama.cpp") else Qt.SolidLine))
        ordered = [(X(x), Y(y)) for x, y in sorted(pts.items()) if y > 0]
        for (x0, y0), (x1, y1) in zip(ordered, ordered[1:]):
            p.drawLine(QPointF(x0, y0), QPointF(x1, y1))
        for x, y in ordered:
            p.drawEllipse(QPointF(x, y), 3, 3)
        ly = top + 10 + 22 * i
        p.drawLine(QPointF(W - right + 16, ly), QPointF(W - right + 46, ly))
        p.setPen(QPen(QColor("black")))
        p.drawText(QRectF(W - right + 52, ly - 9, right - 56, 18), Qt.AlignLeft | Qt.AlignVCenter, name)
    p.end()
    if not img.save(str(path)):
        raise SystemExit(f"could not write {path}")


def main(argv: list[str]) -> int:
    folder, out = Path(argv[0]), Path(argv[1])
    title = argv[2] if len(argv) > 2 else f"Decode tokens/s vs context ({folder.name})"
    app = QGuiApplication.instance() or QGuiApplication(["plot"])  # noqa: F841 (fonts need an app)
    series = series_from(folder)
    if not series:
        raise SystemExit(f"no tandem-*.json or llamacpp-*.json records in {folder}")
    render(series, out, title)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
