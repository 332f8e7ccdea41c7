"""Tandem's desktop app (PySide6). It reaches the engine only through `engine/api.py` and never imports torch."""
