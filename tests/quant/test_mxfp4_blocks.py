"""MXFP4 blocks (gpt-oss's expert format): dequantisation against gguf's own, bit for bit, and products
against an fp32 matmul, on every quantised-kernel ISA this CPU has and the torch fallback.

The blocks are random bytes: every E2M1 code in every nibble, and scale bytes either over the whole
E8M0 range (dequantisation: fp32 subnormals at e = 0, 1 and ±inf at e = 255) or around 2^-4 (products,
weights up to 12·2^-5 ≈ 0.4, O(0.1) as a model's).

Tolerance of the products, as test_block_types.py: the activations are quantised per 32-block to
int16 (d = max|x_b|/32767, round to nearest), so each x_j moves by at most d/2 and an output by at most
Σ_b d_b/2 · Σ_{j∈b} |w_j|; the int32 block sums are exact and convert to float exactly (|q| ≤ 12, two
products of ≤ 12·32767 per lane), so only fp32's summation adds, under 1e-5 of Σ|w||x|.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from engine.errors import ModelFileError
from engine.kernels import native
from engine.quant import matmul as qm
from engine.quant.blocks import QuantStack, QuantTensor, dequantize_blocks_torch

NAT = native.module()
MX = int(T.MXFP4)


def random_blocks(rows: int, cols: int, seed: int = 0, exponents: tuple[int, int] = (124, 126)) -> np.ndarray:
    """(rows, cols/32 · 17) uint8: random code bytes, scale bytes uniform in `exponents` (inclusive)."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
    data[:, :, 0] = rng.integers(exponents[0], exponents[1] + 1, (rows, cols // 32))
    return data.reshape(rows, -1)


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _bound(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    """(n, rows): the largest error the int16 activation rounding can cause, plus fp32's share."""
    n, cols = x.shape
    d = x.reshape(n, cols // 32, 32).abs().amax(-1) / 32767  # (n, blocks)
    wabs = torch.from_numpy(np.abs(w))
    return (d / 2) @ wabs.reshape(w.shape[0], cols // 32, 32).sum(-1).t() + 1e-5 * (x.abs() @ wabs.t()) + 1e-6


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf's own ±inf at e = 255
def test_every_scale_byte_and_code_dequantises_as_gguf(every_isa):
    """All 256 scale bytes × all 256 code bytes (both nibbles' orders), compared as fp32 bit patterns:
    signed zeros, subnormals and infinities included."""
    codes = np.arange(256, dtype=np.uint8)
    blocks = np.zeros((256, 16, 17), dtype=np.uint8)  # (scale byte, block, bytes): 16 blocks hold 256 codes
    blocks[:, :, 0] = np.arange(256, dtype=np.uint8)[:, None]
    blocks[:, :, 1:] = codes.reshape(16, 16)
    data = blocks.reshape(256, -1)
    ref = dequantize(data, T.MXFP4)
    assert np.isinf(ref).any() and (ref[:2] != 0).any()  # the ends of the range are in the test
    w = QuantTensor.from_gguf(data, MX, "w")
    assert w.shape == (256, 512) and w.qtype.name == "MXFP4" and w.nbytes == data.size
    assert np.array_equal(_bits(qm.dequantize_rows(w).numpy()), _bits(ref))
    assert np.array_equal(_bits(dequantize_blocks_torch(w.blocks, MX).numpy()), _bits(ref))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_rows_lookups_and_stacks_are_exact(every_isa):
    data = random_blocks(130, 96, seed=7, exponents=(0, 255))
    ref_w = dequantize(data, T.MXFP4)
    w = QuantTensor.from_gguf(data, MX, "w")
    ids = torch.tensor([[5, 0], [129, 5]])
    assert np.array_equal(_bits(qm.embedding(ids, w).numpy()), _bits(ref_w[ids.numpy()]))
    perm = torch.randperm(130)
    assert np.array_equal(_bits(w[perm].dequantize().numpy()), _bits(ref_w[perm.numpy()]))
    stack = QuantStack.from_gguf(data.reshape(2, 65, -1), MX, "blk.0.ffn_down_exps.weight")  # (E, N, bytes)
    assert stack.shape == (2, 65, 96) and stack.types() == ["MXFP4"]
    assert np.array_equal(_bits(stack.dequantize().numpy()), _bits(ref_w.reshape(2, 65, 96)))


@pytest.mark.parametrize("rows,cols", [(77, 512), (1, 32), (203, 96), (64, 2880)])
@pytest.mark.parametrize("n_tokens", [1, 2, 3, 4, 5, 7, 9, 16])
def test_matmul_matches_dequantised_fp32(every_isa, rows, cols, n_tokens):
    """Odd row counts (tiles of 4, 2, 1 rows and their remainders), widths of 1, 3 and 90 blocks
    (2880: gpt-oss's hidden size), every token group size of the integer kernel."""
    data = random_blocks(rows, cols, seed=rows + cols)
    w, ref_w = QuantTensor.from_gguf(data, MX, "w"), dequantize(data, T.MXFP4)
    x = torch.randn(n_tokens, cols, generator=torch.Generator().manual_seed(n_tokens)) * 3
    ref = x @ torch.from_numpy(ref_w).t()
    y = qm.quant_linear(x, w)
    assert y.shape == (n_tokens, rows) and y.dtype == torch.float32
    assert ((y - ref).abs() <= _bound(x, ref_w)).all(), float((y - ref).abs().max())


def test_the_prefill_path_extreme_codes_and_a_bias(every_isa):
    """24 tokens (dequantised tiles + GEMM on the native path); rows of ±12 codes only (nibble 7 or 15)
    against activations at ±32767; a bias added after the product."""
    data = random_blocks(40, 512, seed=3)
    blocks = data.reshape(40, -1, 17)
    blocks[:8, :, 1:] = np.uint8(0x7F)  # +12, −12 alternating halves
    w, ref_w = QuantTensor.from_gguf(data, MX, "w"), dequantize(data, T.MXFP4)
    bias = torch.randn(40)
    x = torch.randn(24, 512)
    x[:4] = 5.0  # every block of these tokens at its largest int16
    ref = x @ torch.from_numpy(ref_w).t() + bias
    for n in (4, 24):
        y = qm.quant_linear(x[:n], w, bias)
        assert ((y - ref[:n]).abs() <= _bound(x[:n], ref_w)).all(), float((y - ref[:n]).abs().max())


def test_gguf_quantised_weights_round_trip(every_isa):
    """Weights quantised by gguf's MXFP4 quantiser (realistic scale bytes) compute as their
    dequantisation does."""
    rng = np.random.default_rng(1)
    w32 = (rng.standard_normal((48, 256)) * 0.05).astype(np.float32)
    data = quantize(w32, T.MXFP4)
    w, ref_w = QuantTensor.from_gguf(data, MX, "w"), dequantize(data, T.MXFP4)
    x = torch.randn(3, 256)
    ref = x @ torch.from_numpy(ref_w).t()
    assert ((qm.quant_linear(x, w) - ref).abs() <= _bound(x, ref_w)).all()


def test_damaged_blocks_are_refused():
    data = random_blocks(8, 512)
    blocks = torch.from_numpy(data)
    with pytest.raises(ModelFileError, match="truncated or damaged"):
        QuantTensor(blocks[:, :-1], MX, (8, 512), "blk.0.ffn_down_exps.weight")
    with pytest.raises(ModelFileError, match="not whole MXFP4 blocks"):
        QuantTensor.from_gguf(data[:, :-3], MX, "blk.0.ffn_down_exps.weight")


@pytest.mark.skipif(NAT is None, reason="native extension not built")
def test_native_refuses_a_row_off_its_blocks():
    y, x = torch.empty(1, 4), torch.zeros(1, 64)
    with pytest.raises(ValueError, match="whole blocks"):
        NAT.quant_matmul(np.array([[x.data_ptr(), MX, 4, 33]]), 64, x.data_ptr(), 1, 64, y.data_ptr(), 4, 1)
    with pytest.raises(ValueError, match="multiple of the type's block"):
        NAT.quant_matmul(np.array([[x.data_ptr(), MX, 4, 17]]), 48, x.data_ptr(), 1, 48, y.data_ptr(), 4, 1)
