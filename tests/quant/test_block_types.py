"""Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks: dequantisation against gguf's, products against an fp32 matmul.

The blocks are random bytes (every bit pattern of the nibbles, high bits and packed scales) with sane
fp16 scales in their places, so no quantiser stands between the test and the layout.

Tolerance: the activations are quantised per 32-block to int16 (d = max|x_b|/32767, round to nearest),
so each x_j moves by at most d/2 and an output by at most Σ_b d_b/2 · Σ_{j∈b} |w_j| (AVX2's K-quant
products: int8 per 256-block, d = max|x_b|/127, the same sum over 256-blocks; helpers.INT8_ISAS); fp32 rounding of
the sums (and Q6_K's int32 lanes, up to 2^28, converted to float: 2^-24 of themselves) stays under
1e-5 of Σ|w||x|. That bound is what every element is held to. The weights are exact: the kernels'
dequantisation equals gguf's bit for bit.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from helpers import INT8_ISAS

from engine.errors import ModelFileError
from engine.kernels import native
from engine.quant import matmul as qm
from engine.quant.blocks import QTYPES, QuantTensor, dequantize_blocks_torch

TYPES = [T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
NAT = native.module()
# Where each type keeps its fp16 factors, and their size: weights of O(0.1) whatever the random
# integers (Q4_K: d·63·15 ≈ 0.1; Q6_K: d·128·32 ≈ 0.1; Q5_x: d·16).
HALVES = {T.Q5_0: {0: 6e-3}, T.Q5_1: {0: 3e-3, 2: 0.05}, T.Q4_K: {0: 1e-4, 2: 1e-4},
          T.Q5_K: {0: 5e-5, 2: 1e-4}, T.Q6_K: {208: 2.5e-5}}


def random_blocks(rows: int, cols: int, qtype, seed: int = 0) -> np.ndarray:
    """(rows, row bytes) uint8 of `qtype`: random bytes, fp16 factors of either sign at HALVES' sizes."""
    qt, rng = QTYPES[int(qtype)], np.random.default_rng(seed)
    n = cols // qt.block_weights
    data = rng.integers(0, 256, (rows, n, qt.block_bytes), dtype=np.uint8)
    for at, size in HALVES[qtype].items():
        h = (rng.uniform(0.2, 1.0, (rows, n)) * size * rng.choice([-1, 1], (rows, n))).astype(np.float16)
        data[:, :, at:at + 2] = h.view(np.uint8).reshape(rows, n, 2)
    return data.reshape(rows, -1)


# helpers.INT8_ISAS: the ISAs whose K-quant products read the activations as int8 with one scale per
# 256 values (native/kquant_kernels.h's ksuper_tile_i8): d = max|x_b|/127 over each 256-block b, so
# each x_j moves by up to d/2 (max|x_b|/254) and an output by Σ_b d_b/2 · Σ_{j∈b} |w_j|, 258 times
# the int16 bound's reach (127 against 32767, per 256 values against per 32).
K_QUANTS = {int(T.Q4_K), int(T.Q5_K), int(T.Q6_K)}


def int8_form(isa, qtype) -> bool:
    """Whether `isa`'s products over `qtype` blocks read the int8 form of the activations."""
    return isa in INT8_ISAS and qtype is not None and int(qtype) in K_QUANTS


def _bound(x: torch.Tensor, w: np.ndarray, isa=None, qtype=None) -> torch.Tensor:
    """(n, rows): the largest error the activations' rounding can cause (int16 per 32, or int8 per 256
    where `isa` reads `qtype` so), plus fp32's share."""
    n, cols = x.shape
    group, top = (256, 127) if int8_form(isa, qtype) else (32, 32767)
    d = x.reshape(n, cols // group, group).abs().amax(-1) / top  # (n, blocks)
    wabs = torch.from_numpy(np.abs(w))
    return (d / 2) @ wabs.reshape(w.shape[0], cols // group, group).sum(-1).t() + 1e-5 * (x.abs() @ wabs.t()) + 1e-6


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols", [(77, 512), (1, 256), (203, 768)])
@pytest.mark.parametrize("n_tokens", [1, 2, 3, 4, 5, 7, 9, 16])
def test_matmul_matches_dequantised_fp32(every_isa, qtype, rows, cols, n_tokens):
    data = random_blocks(rows, cols, qtype, seed=rows + cols)
    w, ref_w = QuantTensor.from_gguf(data, int(qtype), "w"), dequantize(data, qtype)
    x = torch.randn(n_tokens, cols, generator=torch.Generator().manual_seed(n_tokens)) * 3
    ref = x @ torch.from_numpy(ref_w).t()
    y = qm.quant_linear(x, w)
    assert y.shape == (n_tokens, rows) and y.dtype == torch.float32
    assert ((y - ref).abs() <= _bound(x, ref_w, every_isa, qtype)).all(), float((y - ref).abs().max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_prefill_path_and_extreme_blocks(every_isa, qtype):
    """24 tokens (dequantised tiles + GEMM on the native path), and blocks whose integers are all at
    one end: Q6_K's q' = (0 − 32)·(−128) = 4096 in every weight against activations at ±32767."""
    data = random_blocks(40, 512, qtype, seed=3)
    qt = QTYPES[int(qtype)]
    if qtype == T.Q6_K:
        blocks = data.reshape(40, -1, qt.block_bytes)
        blocks[:8, :, :192] = 0  # q = 0
        blocks[:8, :, 192:208] = np.uint8(0x80)  # sc = −128
    w, ref_w = QuantTensor.from_gguf(data, int(qtype), "w"), dequantize(data, qtype)
    x = torch.randn(24, 512)
    x[:4] = 5.0  # every block of these tokens at its largest int16
    ref = x @ torch.from_numpy(ref_w).t()
    for n in (4, 24):
        y = qm.quant_linear(x[:n], w)
        assert ((y - ref[:n]).abs() <= _bound(x[:n], ref_w, every_isa, qtype)).all(), float((y - ref[:n]).abs().max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantise_and_rows_are_exact(every_isa, qtype):
    data = random_blocks(130, 512, qtype, seed=7)
    w, ref_w = QuantTensor.from_gguf(data, int(qtype), "w"), dequantize(data, qtype)
    assert w.shape == (130, 512)
    assert np.array_equal(qm.dequantize_rows(w).numpy(), ref_w)
    assert np.array_equal(dequantize_blocks_torch(w.blocks, int(qtype)).numpy(), ref_w)
    ids = torch.tensor([[5, 0], [129, 5]])
    assert np.array_equal(qm.embedding(ids, w).numpy(), ref_w[ids.numpy()])
    perm = torch.randperm(130)
    assert np.array_equal(w[perm].dequantize().numpy(), ref_w[perm.numpy()])
    both = QuantTensor.cat_rows([w, w[:7]])
    assert np.array_equal(both.dequantize().numpy(), np.concatenate([ref_w, ref_w[:7]]))


def test_rows_of_different_types_do_not_stack():
    q4k = QuantTensor.from_gguf(random_blocks(4, 256, T.Q4_K), int(T.Q4_K), "gate")
    q6k = QuantTensor.from_gguf(random_blocks(4, 256, T.Q6_K), int(T.Q6_K), "up")
    with pytest.raises(ValueError, match="different types"):
        QuantTensor.cat_rows([q4k, q6k])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_damaged_blocks_are_refused(qtype):
    qt = QTYPES[int(qtype)]
    data = random_blocks(8, 512, qtype)
    blocks = torch.from_numpy(data)
    with pytest.raises(ModelFileError, match="truncated or damaged"):
        QuantTensor(blocks[:, :-1], int(qtype), (8, 512), "blk.0.ffn_down.weight")  # a row short of a byte
    with pytest.raises(ModelFileError, match=f"not whole {qt.name} blocks"):
        QuantTensor.from_gguf(data[:, :-3], int(qtype), "blk.0.ffn_down.weight")
    with pytest.raises(ModelFileError, match=f"not whole {qt.name} blocks of {qt.block_weights}"):
        QuantTensor(blocks[:, :qt.block_bytes], int(qtype), (8, qt.block_weights + 16), "w")


@pytest.mark.skipif(NAT is None, reason="native extension not built")
def test_native_refuses_a_k_quant_width_off_its_super_block():
    y, x = torch.empty(1, 4), torch.zeros(1, 288)
    with pytest.raises(ValueError, match="multiple of the type's block"):
        NAT.quant_matmul(np.array([[x.data_ptr(), int(T.Q4_K), 4, 144]]), 288, x.data_ptr(), 1, 288, y.data_ptr(), 4, 1)
    with pytest.raises(ValueError, match="whole blocks"):
        NAT.quant_matmul(np.array([[x.data_ptr(), int(T.Q6_K), 4, 209]]), 256, x.data_ptr(), 1, 256, y.data_ptr(), 4, 1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bf16_dequantisation_is_the_fp32_one_rounded(every_isa, qtype):
    """The routed experts' prefill tiles: each ISA writes bf16 itself, equal to its fp32 values rounded
    to nearest even (torch's conversion), all rows and picked rows alike."""
    w = QuantTensor.from_gguf(random_blocks(37, 512, qtype, seed=5), int(qtype), "w")
    want = qm.dequantize_rows(w).to(torch.bfloat16)
    assert torch.equal(qm.dequantize_rows(w, dtype=torch.bfloat16), want)
    rows = torch.tensor([36, 0, 7])
    assert torch.equal(qm.dequantize_rows(w, rows=rows, dtype=torch.bfloat16), want[rows])
    assert torch.equal(qm.dequantize_rows(w, row_range=(3, 9), dtype=torch.bfloat16), want[3:9])


def test_stacked_matrices_are_one_and_their_parts_views_of_it():
    g = np.random.default_rng(3)
    q, k = (QuantTensor(torch.from_numpy(quantize(g.standard_normal((n, 64)).astype(np.float32), T.Q8_0)),
                        T.Q8_0, (n, 64), name) for n, name in ((8, "q"), (4, "k")))
    both = QuantTensor.stacked([q, k], "qk")
    assert both.shape == (12, 64) and torch.equal(both.dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    q_view, k_view = both.parts_of([8, 4])
    assert torch.equal(k_view.dequantize(), k.dequantize()) and k_view.blocks.data_ptr() == both.blocks[8:].data_ptr()
    other = QuantTensor(torch.from_numpy(quantize(g.standard_normal((4, 64)).astype(np.float32), T.Q4_0)),
                        T.Q4_0, (4, 64), "v")
    with pytest.raises(ValueError, match="one type"):
        QuantTensor.stacked([q, other], "qv")
