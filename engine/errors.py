"""Errors the engine raises for bad input: each says what happened and what to do.

Every error carries `what` (the cause, naming the file or value) and `remedy` (the user's next
step), so a UI can show both without a traceback.
"""

from __future__ import annotations


class TandemError(Exception):
    """Base of every error meant for the user."""

    def __init__(self, what: str, remedy: str = ""):
        self.what = what
        self.remedy = remedy
        super().__init__(f"{what} — {remedy}" if remedy else what)


class ModelFileError(TandemError):
    """A model file is missing, truncated, corrupt or of a shape the config does not allow."""


class UnsupportedModelError(TandemError):
    """The file is readable but names an architecture, quant type or feature Tandem lacks."""


class ContextOverflowError(TandemError):
    """A prompt (plus the tokens asked for) does not fit the context window."""


class ConfigError(TandemError):
    """An EngineConfig value is invalid or unavailable on this machine."""


class OutOfMemoryError(TandemError):
    """An allocation failed on the device or the host."""


class KernelInputError(TandemError, ValueError):
    """A compute kernel got tensors of the wrong shape, dtype, device or layout (a caller's bug)."""


class ComputeError(TandemError):
    """A compute step failed mid-generation (a CPU kernel, or the GPU side reporting an error)."""
