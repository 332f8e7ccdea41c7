"""One product over several matrices' rows (QuantRows): a layer's q, k and v, or gate and up, in one
native call whose activations are quantised once. Each part keeps its own type (Q4_K_M files mix
Q4_K and Q6_K in a layer), so the result must equal the parts' products side by side, on every ISA
and in the dequantised-tiles path of longer prompts. Tolerances: test_block_types' bound."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from test_block_types import _bound, random_blocks

from engine.kernels import native
from engine.quant import matmul as qm
from engine.quant.blocks import QuantRows, QuantTensor

NAT = native.module()
needs_native = pytest.mark.skipif(NAT is None or not hasattr(NAT, "quant_matmul"), reason="no native extension")


def _parts(spec, cols):
    """[(type, rows)] → the QuantTensors and their dequantised weights."""
    tensors, weights = [], []
    for i, (qtype, rows) in enumerate(spec):
        data = random_blocks(rows, cols, qtype, seed=7 + i)
        tensors.append(QuantTensor.from_gguf(data, int(qtype), f"part{i}"))
        weights.append(dequantize(data, qtype))
    return tensors, np.concatenate(weights)


@pytest.mark.parametrize("n_tokens", [1, 3, 16, 40])  # 40: past NATIVE_MAX_TOKENS, the tiles' path
def test_mixed_parts_equal_their_products_side_by_side(every_isa, n_tokens):
    spec = [(T.Q4_K, 64), (T.Q6_K, 17), (T.Q5_K, 33)]  # rows that do not split evenly between threads
    tensors, w = _parts(spec, 512)
    x = torch.randn(n_tokens, 512, generator=torch.Generator().manual_seed(n_tokens)) * 3
    y = qm.quant_linear(x, QuantRows(tensors, "qkv"))
    ref = x @ torch.from_numpy(w).t()
    assert y.shape == (n_tokens, 114)
    assert ((y - ref).abs() <= _bound(x, w, every_isa, T.Q4_K)).all(), float((y - ref).abs().max())  # all K-quants


def test_parts_take_a_bias_and_keep_the_leading_dims(every_isa):
    tensors, w = _parts([(T.Q4_K, 8), (T.Q6_K, 8)], 256)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(1))
    bias = torch.arange(16, dtype=torch.float32)
    y = qm.quant_linear(x, QuantRows(tensors), bias)
    ref = x @ torch.from_numpy(w).t() + bias
    assert y.shape == (2, 3, 16)
    assert ((y - ref).abs() <= _bound(x.reshape(6, 256), w, every_isa, T.Q4_K).reshape(2, 3, 16)).all()


@needs_native
def test_native_parts_check_the_table_and_the_output_width():
    tensors, _ = _parts([(T.Q4_K, 4), (T.Q6_K, 4)], 256)
    parts = QuantRows(tensors).native_parts  # (2, 4)
    x, y = torch.randn(1, 256), torch.full((1, 9), 7.0)
    NAT.quant_matmul(parts, 256, x.data_ptr(), 1, 256, y.data_ptr(), 9, 1)
    assert (y[:, 8] == 7.0).all()  # the column past both parts is left alone
    with pytest.raises(ValueError, match="y_stride must cover every part"):
        NAT.quant_matmul(parts, 256, x.data_ptr(), 1, 256, y.data_ptr(), 7, 1)
    with pytest.raises(ValueError, match="whole blocks"):
        bad = parts.copy()
        bad[1, 3] -= 1  # a row of Q6_K one byte short
        NAT.quant_matmul(bad, 256, x.data_ptr(), 1, 256, y.data_ptr(), 9, 1)
    with pytest.raises(ValueError, match=r"\(P, 4\)"):
        NAT.quant_matmul(parts[:, :3].copy(), 256, x.data_ptr(), 1, 256, y.data_ptr(), 9, 1)
