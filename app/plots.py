"""Two small live plots painted with QPainter: a time chart with axes and a stacked memory bar.

Qt Charts is not part of PySide6-Essentials, and these two shapes are all the panels need. Missing
values (None) are gaps in a line or absent segments, never drawn as zero.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPainterPath, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget


@dataclass
class Series:
    name: str
    color: QColor
    dashed: bool = False
    label: str = ""  # the legend's word for it (empty: no legend entry)


def nice_top(v: float) -> float:
    """The smallest 1, 2 or 5 × 10^k at or above v: a y-axis top that reads as a round number."""
    if v <= 0:
        return 1.0
    k = math.floor(math.log10(v))
    for m in (1, 2, 5, 10):
        if m * 10**k >= v * 0.999:
            return float(m * 10**k)
    return float(10 ** (k + 1))


def axis_number(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}" if v >= 1 or v == 0 else f"{v:.2g}"


class Sparkline(QWidget):
    """The last `window_s` seconds of one or more series against time, with axes: y from 0 to a fixed
    or a rounded running maximum (labelled with the unit), x from −window_s to now.

    Samples carry their own time (the snapshot's "t"), so the chart keeps what happened in the last
    minute while the engine is idle instead of scrolling it away sample by sample. With no value in
    the window it says so in words (`empty_text`), never as a flat zero."""

    MARGIN_L, MARGIN_B, MARGIN_T = 34, 14, 4

    def __init__(self, series: list[Series], y_max: float | None = None, history: int = 600,
                 unit: str = "", window_s: float = 60.0, percent: bool = False, parent=None):
        super().__init__(parent)
        self.series = series
        self.y_max = y_max  # None: scale to the largest value shown
        self.unit, self.window_s, self.percent = unit, window_s, percent
        self.data = {s.name: deque(maxlen=history) for s in series}
        self.times: deque = deque(maxlen=history)
        self.empty_text = "waiting for samples"
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumHeight(70)

    def sizeHint(self) -> QSize:
        return QSize(240, 78)

    def add(self, values: dict, t: float | None = None) -> None:
        self.times.append(time.time() if t is None else float(t))
        for s in self.series:
            v = values.get(s.name)
            self.data[s.name].append(None if v is None else float(v))
        self.update()

    def values(self, name: str) -> list:
        return list(self.data[name])

    def visible(self) -> list[int]:
        """Indexes of the samples inside the window (the newest sample's time is 'now')."""
        if not self.times:
            return []
        now = self.times[-1]
        return [i for i, t in enumerate(self.times) if now - t <= self.window_s]

    def top(self) -> float:
        if self.y_max is not None:
            return self.y_max
        idx = self.visible()
        seen = [d[i] for d in self.data.values() for i in idx if d[i] is not None]
        return nice_top(max(seen) * 1.05) if seen and max(seen) > 0 else 1.0

    def has_values(self) -> bool:
        idx = self.visible()
        return any(d[i] is not None for d in self.data.values() for i in idx)

    def y_label(self, v: float) -> str:
        return f"{v * 100:.0f}%" if self.percent else axis_number(v)

    def paintEvent(self, _event) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        pal = self.palette()
        small = QFont(self.font())
        small.setPointSizeF(max(6.5, small.pointSizeF() * 0.8))
        p.setFont(small)
        fm = p.fontMetrics()
        outer = QRectF(self.rect()).adjusted(0, 0, -1, -1)
        plot = outer.adjusted(self.MARGIN_L, self.MARGIN_T, -2, -self.MARGIN_B)
        p.fillRect(plot, pal.color(QPalette.ColorRole.Base))
        top = self.top()
        grid = QColor(pal.color(QPalette.ColorRole.Mid))
        grid.setAlpha(90)
        text_pen = QPen(pal.color(QPalette.ColorRole.PlaceholderText))
        for frac in (0.0, 0.5, 1.0):  # y axis: 0, half, top, with the unit on the top label
            y = plot.bottom() - frac * plot.height()
            p.setPen(QPen(grid, 1))
            p.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
            p.setPen(text_pen)
            label = self.y_label(top * frac)
            if frac == 1.0 and self.unit:
                label = f"{label} {self.unit}"
            w = fm.horizontalAdvance(label)
            x = max(outer.left(), plot.left() - 3 - w) if frac < 1.0 or w < self.MARGIN_L - 3 else plot.left() + 3
            p.drawText(QPointF(x, y + fm.ascent() / 2 - 1 if frac > 0 else y), label)
        for k, text in ((0.0, f"−{self.window_s:.0f} s"), (0.5, f"−{self.window_s / 2:.0f} s"), (1.0, "now")):
            x = plot.left() + k * plot.width()
            p.setPen(QPen(grid, 1))
            p.drawLine(QPointF(x, plot.top()), QPointF(x, plot.bottom()))
            p.setPen(text_pen)
            w = fm.horizontalAdvance(text)
            p.drawText(QPointF(min(max(x - w / 2, plot.left()), plot.right() - w), outer.bottom() - 1), text)
        p.setPen(QPen(pal.color(QPalette.ColorRole.Mid), 1))
        p.drawRect(plot)
        idx = self.visible()
        now = self.times[-1] if self.times else 0.0
        for s in self.series:
            pen = QPen(s.color, 1.6)
            if s.dashed:
                pen.setStyle(Qt.PenStyle.DashLine)
            p.setPen(pen)
            path, drawing = QPainterPath(), False
            for i in idx:
                v = self.data[s.name][i]
                if v is None:
                    drawing = False
                    continue
                x = plot.right() - (now - self.times[i]) / self.window_s * plot.width()
                y = plot.bottom() - min(v / top, 1.0) * (plot.height() - 2) - 1
                if drawing:
                    path.lineTo(x, y)
                else:
                    path.moveTo(x, y)
                    drawing = True
            p.drawPath(path)
        legend = [s for s in self.series if s.label]
        width = sum(13 + fm.horizontalAdvance(s.label) + 10 for s in legend) - 10
        x = plot.right() - 4 - width
        if legend:  # on a backing of its own: a line running under it stays behind, the words stay readable
            back = QColor(pal.color(QPalette.ColorRole.Base))
            back.setAlpha(220)
            p.fillRect(QRectF(x - 3, plot.top() + 1, width + 6, fm.height()), back)
        for s in legend:  # legend along the top right, inside the plot, clear of the y axis's top label
            p.setPen(QPen(s.color, 2))
            p.drawLine(QPointF(x, plot.top() + 7), QPointF(x + 10, plot.top() + 7))
            p.setPen(text_pen)
            p.drawText(QPointF(x + 13, plot.top() + 7 + fm.ascent() / 2 - 1), s.label)
            x += 13 + fm.horizontalAdvance(s.label) + 10
        if not self.has_values():
            p.setPen(text_pen)
            p.drawText(plot, Qt.AlignmentFlag.AlignCenter, self.empty_text)
        p.end()


@dataclass
class Segment:
    name: str
    value: int | None  # bytes
    color: QColor


class StackedBar(QWidget):
    """Memory regions stacked left to right, scaled to the device total, with the budget marked."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.segments: list[Segment] = []
        self.budget: int | None = None
        self.total: int | None = None
        self.setMinimumHeight(22)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(240, 24)

    def set_data(self, segments: list[Segment], budget: int | None, total: int | None) -> None:
        self.segments, self.budget, self.total = segments, budget, total
        self.update()

    def scale(self) -> float | None:
        known = sum(s.value for s in self.segments if s.value)
        return float(self.total or self.budget or known or 0) or None

    def paintEvent(self, _event) -> None:
        p = QPainter(self)
        pal = self.palette()
        rect = QRectF(self.rect()).adjusted(1, 1, -1, -1)
        p.fillRect(rect, pal.color(QPalette.ColorRole.Base))
        full = self.scale()
        if full is None:
            p.setPen(pal.color(QPalette.ColorRole.PlaceholderText))
            p.drawText(rect, Qt.AlignmentFlag.AlignCenter, "n/a")
        else:
            x = rect.left()
            for s in self.segments:
                if not s.value:
                    continue
                w = rect.width() * s.value / full
                p.fillRect(QRectF(x, rect.top(), w, rect.height()), s.color)
                x += w
            if self.budget:
                bx = rect.left() + rect.width() * min(self.budget / full, 1.0)
                p.setPen(QPen(pal.color(QPalette.ColorRole.Text), 2, Qt.PenStyle.DashLine))
                p.drawLine(QPointF(bx, rect.top()), QPointF(bx, rect.bottom()))
        p.setPen(QPen(pal.color(QPalette.ColorRole.Mid), 1))
        p.drawRect(rect)
        p.end()
