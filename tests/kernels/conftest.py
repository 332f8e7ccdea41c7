import sys

import pytest

from engine.kernels import native


def kernel_modes() -> list[str]:
    """Every native ISA this CPU runs, then the torch fallback."""
    m = native.module()
    return (m.supported_isas() if m is not None else []) + ["torch"]


@pytest.fixture(params=kernel_modes())
def kernel_mode(request, monkeypatch):
    """Runs a test once per native ISA (pinned with select_isa) and once with the extension hidden."""
    mode = request.param
    if mode == "torch":
        monkeypatch.setitem(sys.modules, "engine._native", None)  # the import now fails
        native.reload()
        assert native.module() is None and "not available" in native.load_error()
    else:
        assert native.module().select_isa(mode)
    yield mode
    if mode == "torch":
        monkeypatch.undo()
    native.reload()
    if native.module() is not None:
        native.module().select_isa("auto")


@pytest.fixture
def amx_everywhere():
    """amx-bf16 with the AMX tiles for every token count (else they start at amx_min_tokens); skipped
    where this CPU has no AMX."""
    m = native.module()
    if m is None or "amx-bf16" not in m.supported_isas():
        pytest.skip("this CPU has no AMX")
    assert m.select_isa("amx-bf16")
    saved = m.amx_min_tokens()
    m.set_amx_min_tokens(1)
    yield m
    m.set_amx_min_tokens(saved)
    m.select_isa("auto")
