"""The `every_isa` fixture of the quantised-kernel tests: each instruction set the native kernels have
on this machine, selected for the test and put back after it, then the torch fallback (the
extension hidden from engine.quant.matmul)."""

import pytest

from engine.kernels import native
from engine.quant import blocks

NAT = native.module()
ISAS = NAT.supported_quant_isas() if NAT is not None and hasattr(NAT, "supported_quant_isas") else []


@pytest.fixture(params=ISAS + ["torch"])
def every_isa(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(blocks, "native_quant", lambda: None)
    else:
        assert NAT.select_quant_isa(request.param)
    yield request.param
    if request.param != "torch":
        NAT.select_quant_isa("auto")
