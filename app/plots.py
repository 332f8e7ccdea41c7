"""Two small live plots painted with QPainter: a multi-series sparkline and a stacked memory bar.

Qt Charts is not part of PySide6-Essentials, and these two shapes are all the panels need. Missing
values (None) are gaps in a line or absent segments, never drawn as zero.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget


@dataclass
class Series:
    name: str
    color: QColor
    dashed: bool = False


class Sparkline(QWidget):
    """The last `history` samples of one or more series; y from 0 to a fixed or running maximum."""

    def __init__(self, series: list[Series], y_max: float | None = None, history: int = 240, parent=None):
        super().__init__(parent)
        self.series = series
        self.y_max = y_max  # None: scale to the largest value shown
        self.data = {s.name: deque(maxlen=history) for s in series}
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumHeight(48)

    def sizeHint(self) -> QSize:
        return QSize(240, 56)

    def add(self, values: dict) -> None:
        for s in self.series:
            v = values.get(s.name)
            self.data[s.name].append(None if v is None else float(v))
        self.update()

    def values(self, name: str) -> list:
        return list(self.data[name])

    def top(self) -> float:
        if self.y_max is not None:
            return self.y_max
        seen = [v for d in self.data.values() for v in d if v is not None]
        return max(seen) * 1.1 if seen and max(seen) > 0 else 1.0

    def paintEvent(self, _event) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        pal = self.palette()
        rect = QRectF(self.rect()).adjusted(1, 1, -1, -1)
        p.fillRect(rect, pal.color(QPalette.ColorRole.Base))
        p.setPen(QPen(pal.color(QPalette.ColorRole.Mid), 1))
        p.drawRect(rect)
        top = self.top()
        n = max((len(d) for d in self.data.values()), default=0)
        cap = max(d.maxlen for d in self.data.values())
        step = rect.width() / max(cap - 1, 1)
        for s in self.series:
            pts = list(self.data[s.name])
            pen = QPen(s.color, 1.6)
            if s.dashed:
                pen.setStyle(Qt.PenStyle.DashLine)
            p.setPen(pen)
            path, drawing = QPainterPath(), False
            for i, v in enumerate(pts):
                if v is None:
                    drawing = False
                    continue
                x = rect.right() - (len(pts) - 1 - i) * step  # newest sample at the right edge
                y = rect.bottom() - min(v / top, 1.0) * (rect.height() - 4) - 2
                if drawing:
                    path.lineTo(x, y)
                else:
                    path.moveTo(x, y)
                    drawing = True
            p.drawPath(path)
        if all(v is None for d in self.data.values() for v in d):
            p.setPen(pal.color(QPalette.ColorRole.PlaceholderText))
            p.drawText(rect, Qt.AlignmentFlag.AlignCenter, "n/a" if n else "waiting for samples")
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
