"""The app's look: one style sheet (assets/style.qss) filled with colours for the system's light or
dark palette, so the app follows the desktop's theme instead of painting light boxes on a dark one."""

from __future__ import annotations

from pathlib import Path
from string import Template

from PySide6.QtGui import QGuiApplication, QPalette

LIGHT = {"bg": "#f6f7f9", "card": "#ffffff", "user": "#e9f2fc", "user_border": "#c9dcf2", "border": "#dde1e6",
         "soft": "#eef1f4", "text": "#1f2328", "muted": "#6b7280", "accent": "#1f9e89", "accent_text": "#ffffff",
         "warn": "#8a5a00", "warn_bg": "#fff6d6", "warn_border": "#f0d477", "bad": "#b42318", "bad_bg": "#fdecec",
         "bad_border": "#f3b7b3", "selected": "#d7ebe7", "code": "#f1f3f5", "tag": "#8a6d00"}
DARK = {"bg": "#1d1f23", "card": "#26292e", "user": "#22344a", "user_border": "#2f4a68", "border": "#3a3e45",
        "soft": "#2d3137", "text": "#e6e8eb", "muted": "#9aa1aa", "accent": "#2bb39c", "accent_text": "#0d1412",
        "warn": "#f0c35a", "warn_bg": "#3a3220", "warn_border": "#6b5a2a", "bad": "#ff8a80", "bad_bg": "#3a2424",
        "bad_border": "#6b3a3a", "selected": "#24433d", "code": "#1a1c20", "tag": "#e0c064"}


def is_dark(palette: QPalette | None = None) -> bool:
    palette = palette or QGuiApplication.palette()
    return palette.color(QPalette.ColorRole.Window).lightness() < 128


def colours(palette: QPalette | None = None) -> dict:
    return DARK if is_dark(palette) else LIGHT


def style_sheet(template: Path, palette: QPalette | None = None) -> str:
    """The style sheet for this palette ($names in the file are the colours above)."""
    return Template(template.read_text()).substitute(colours(palette))
