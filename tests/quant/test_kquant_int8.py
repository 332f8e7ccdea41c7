"""The K-quant products over int8 activations (AVX2: native/kquant_kernels.h's ksuper_tile_i8) against
gguf's dequantisation and a float matmul, on random blocks at odd shapes: several super-blocks a
row, 1 to 8 tokens (off the kernel's groups of 4), row counts off its 4-row tiles.

Two references, two tolerances:
- the activations rounded as the kernel rounds them (int8 per 256 values, d = max|x|/127, nearest
  even: `int8_form` below, numpy's float32 arithmetic as the kernel's), times the dequantised
  weights in float64. The kernel's integer sums are exact, so what is left is fp32's: one int32 →
  float conversion per super-block (2^-24 of itself), the factors d·a_d and dmin·a_d, the FMAs and
  the 8 lanes' sum; under 1e-6 of Σ|w||x| (measured: 4e-8). A scale, min or sixth bit read from
  the wrong place, or a sum on the wrong 16 activations, is off by O(|w||x|/√k) ≫ that.
- the activations as they are: test_block_types' bound, which for this form is Σ_b d_b/2 ·
  Σ_{j∈b} |w_j| over 256-blocks b (each x_j moved by at most max|x_b|/254), plus the fp32 share.
On an ISA that reads the int16 form (AVX-512, scalar) only the second applies.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from test_block_types import _bound, int8_form, random_blocks

from engine.quant import matmul as qm
from engine.quant.blocks import QuantTensor

KQ = [T.Q4_K, T.Q5_K, T.Q6_K]
SHAPES = [(5, 2048, 1), (7, 256, 3), (130, 768, 4), (9, 1280, 6), (3, 512, 8), (33, 1024, 5), (1, 256, 2),
          (67, 1536, 7)]


def int8_rounded(x: torch.Tensor) -> np.ndarray:
    """x as the int8 form holds it, q·d, in float64 (quantize_acts8 in native/quant_kernels.h)."""
    xs = x.numpy().astype(np.float32)
    n, k = xs.shape
    xb = xs.reshape(n, k // 256, 256)
    amax = np.abs(xb).max(-1, keepdims=True)
    safe = np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)  # float32 product, rounded to nearest even as vcvtps2dq does
    assert np.abs(q).max() <= 127
    d = (amax / np.float32(127)).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(n, k)


@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols,n_tokens", SHAPES)
def test_products_against_gguf_and_a_float_matmul(every_isa, qtype, rows, cols, n_tokens):
    data = random_blocks(rows, cols, qtype, seed=rows * 7 + cols + n_tokens)
    w = dequantize(data, qtype)
    x = torch.randn(n_tokens, cols, generator=torch.Generator().manual_seed(rows + n_tokens)) * 2
    x[0, :17] *= 40  # one 256-block's scale set by a few large values: the rest lose precision
    y = qm.quant_linear(x, QuantTensor.from_gguf(data, int(qtype), "w"))
    assert y.shape == (n_tokens, rows)
    ref = x @ torch.from_numpy(w).t()
    assert ((y - ref).abs() <= _bound(x, w, every_isa, qtype)).all(), float((y - ref).abs().max())
    if int8_form(every_isa, qtype) and n_tokens <= qm.NATIVE_MAX_TOKENS:
        w64 = w.astype(np.float64)
        ref8 = int8_rounded(x) @ w64.T
        scale = np.abs(x.numpy()).astype(np.float64) @ np.abs(w64).T
        err = np.abs(y.numpy() - ref8)
        assert (err <= 1e-6 * scale + 1e-9).all(), float((err / scale).max())


@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
def test_activation_extremes(every_isa, qtype):
    """All-zero 256-blocks (d = 0), a block of one sign at its largest (±127 everywhere: vpmaddubsw's
    sums at their largest against 6-bit weights), and tiny values next to large ones."""
    data = random_blocks(11, 1024, qtype, seed=9)
    w = dequantize(data, qtype)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(4))
    x[0, :256] = 0.0
    x[1, 256:512] = -7.0
    x[1, 512:768] = 7.0
    x[2, 768:] *= 1e-6
    x[2, 768] = 3.0
    y = qm.quant_linear(x, QuantTensor.from_gguf(data, int(qtype), "w"))
    ref = x @ torch.from_numpy(w).t()
    assert ((y - ref).abs() <= _bound(x, w, every_isa, qtype)).all(), float((y - ref).abs().max())
    if int8_form(every_isa, qtype):
        w64 = w.astype(np.float64)
        err = np.abs(y.numpy() - int8_rounded(x) @ w64.T)
        assert (err <= 1e-6 * (np.abs(x.numpy()).astype(np.float64) @ np.abs(w64).T) + 1e-9).all()
