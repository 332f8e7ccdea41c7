"""The Triton dequantisation of GGUF blocks into expert slots (engine/kernels/dequant_gpu.py) against
gguf's own, bit for bit: every kept type, bf16/fp16/fp32 pools, slots out of order, a part at an offset
inside the slot. Interpreted on CPU tensors here (tests/conftest.py sets TRITON_INTERPRET=1 without
CUDA); compiled on CUDA with `-m cuda`. The dense products over blocks (engine/kernels/quant_linear_gpu.py)
dequantise a batch's weights through them.

The blocks are random bytes (every nibble, high bit and packed scale pattern) with finite fp16 factors
from 2^-20 (fp16 subnormals) to 1 of either sign; MXFP4's exponent byte takes all 256 values (its
subnormal scales, and ±inf past fp32's range as gguf gives them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

pytest.importorskip("triton")

from engine.kernels import dequant_gpu  # noqa: E402
from engine.quant.blocks import QTYPES  # noqa: E402

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.Q4_K, T.Q5_K, T.Q6_K]
FACTORS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.MXFP4: [],
           T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}  # byte offsets of each block's fp16 factors
# the interpreter's numpy says so when MXFP4's largest exponents overflow to ±inf (as they should)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=CUDA)]


def random_blocks(rows: int, cols: int, qtype, seed: int) -> np.ndarray:
    """(rows, row bytes) uint8 of `qtype`: random bytes with finite fp16 factors in their places."""
    qt, rng = QTYPES[int(qtype)], np.random.default_rng(seed)
    n = cols // qt.block_weights
    data = rng.integers(0, 256, (rows, n, qt.block_bytes), dtype=np.uint8)
    for at in FACTORS[qtype]:
        h = (2.0 ** rng.uniform(-20, 0, (rows, n)) * rng.choice([-1, 1], (rows, n))).astype(np.float16)
        data[:, :, at:at + 2] = h.view(np.uint8).reshape(rows, n, 2)
    return data.reshape(rows, -1)


def on(device: str) -> torch.device:
    if device == "cpu" and not dequant_gpu.interpreted():
        pytest.skip("CPU tensors need Triton's interpreter (set where there is no CUDA)")
    return torch.device(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_equals_ggufs_dequantisation(qtype, dtype, device):
    device = on(device)
    n, rows, cols, offset = 3, 5, 512, 40  # 5 rows of 512: 80 rows of 32, two programs' tiles
    data = random_blocks(n * rows, cols, qtype, seed=int(qtype))
    with np.errstate(over="ignore"):  # MXFP4's largest exponents overflow to ±inf, as they should
        want = torch.from_numpy(dequantize(data, qtype).astype(np.float32)).reshape(n, rows * cols)
    blocks = torch.from_numpy(data.reshape(n, -1).copy()).to(device)  # (n, part bytes)
    pool = torch.full((6, offset + rows * cols + 24), 7.0, dtype=dtype, device=device)
    slots = torch.tensor([4, 0, 3], device=device)  # out of order, some slots left alone
    dequant_gpu.dequantize_into(pool, slots, blocks, int(qtype), offset)
    got = pool.cpu()
    assert torch.equal(got[[4, 0, 3], offset:offset + rows * cols], want.to(dtype))  # one rounding, from fp32
    assert (got[[1, 2, 5]] == 7).all() and (got[:, :offset] == 7).all() and (got[:, offset + rows * cols:] == 7).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_an_fp16_pool(qtype, device):
    device = on(device)
    data = random_blocks(4, 256, qtype, seed=1)
    want = torch.from_numpy(dequantize(data, qtype).astype(np.float32)).reshape(2, -1)
    pool = torch.zeros(2, 512, dtype=torch.float16, device=device)
    dequant_gpu.dequantize_into(pool, torch.tensor([1, 0], device=device),
                                torch.from_numpy(data.reshape(2, -1).copy()).to(device), int(qtype), 0)
    assert torch.equal(pool.cpu(), want.to(torch.float16)[[1, 0]])


def test_misshapen_arguments_are_refused():
    pool, slots = torch.zeros(2, 64), torch.tensor([0])
    blocks = torch.zeros(1, 36, dtype=torch.uint8)  # two Q4_0 blocks: 64 weights
    with pytest.raises(ValueError, match="do not fit"):
        dequant_gpu.dequantize_into(pool, slots, blocks, int(T.Q4_0), 1)
    with pytest.raises(ValueError, match="whole 18-byte blocks"):
        dequant_gpu.dequantize_into(pool, slots, blocks[:, :30], int(T.Q4_0), 0)
    with pytest.raises(ValueError, match="int64"):
        dequant_gpu.dequantize_into(pool, slots.int(), blocks, int(T.Q4_0), 0)
    with pytest.raises(ValueError, match="pool dtype"):
        dequant_gpu.dequantize_into(pool.double(), slots, blocks, int(T.Q4_0), 0)


def test_available_needs_cuda_or_the_interpreter():
    assert dequant_gpu.available(torch.device("cpu")) == dequant_gpu.interpreted()
