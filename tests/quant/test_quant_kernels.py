"""The products over quantised blocks against gguf's own dequantisation and an fp32 matmul.

Tolerance: the activations are quantised per 32-block to int16 (d = max|x_b|/32767, round to nearest),
so each x_j moves by at most d/2 and an output by at most Σ_b d_b/2 · Σ_{j∈b} |w_j|: that bound, plus
fp32 rounding of the sums (1e-5 relative to Σ|w||x|), is what every element is held to. The weights
themselves are exact: the kernels' dequantisation equals gguf's bit for bit.
"""

import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from engine.errors import KernelInputError, ModelFileError
from engine.kernels import native
from engine.quant import blocks as qb
from engine.quant import matmul as qm
from engine.quant.blocks import QuantTensor, dequantize_blocks_torch

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]
NAT = native.module()
ISAS = NAT.supported_quant_isas() if NAT is not None and hasattr(NAT, "supported_quant_isas") else []


@pytest.fixture(params=ISAS or ["torch"])
def isa(request):
    if request.param != "torch":
        assert NAT.select_quant_isa(request.param)
    yield request.param
    if request.param != "torch":
        NAT.select_quant_isa("auto")


def _blocks(rows, cols, qtype, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2.0, (rows, 1))).astype(np.float32)
    data = quantize(w, qtype)  # (rows, row bytes) uint8
    return QuantTensor.from_gguf(data, int(qtype), "w"), dequantize(data, qtype)


def _bound(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    """(n, rows): the largest error the int16 activation rounding can cause, plus fp32's share."""
    n, cols = x.shape
    d = x.reshape(n, cols // 32, 32).abs().amax(-1) / 32767  # (n, blocks)
    wabs = torch.from_numpy(np.abs(w)).reshape(w.shape[0], cols // 32, 32).sum(-1)  # (rows, blocks)
    return (d / 2) @ wabs.t() + 1e-5 * (x.abs() @ torch.from_numpy(np.abs(w)).t()) + 1e-6


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols", [(77, 320), (1, 32), (203, 96), (64, 1536)])
@pytest.mark.parametrize("n_tokens", [1, 2, 3, 4, 5, 7, 8, 24])
def test_matmul_matches_dequantised_fp32(isa, qtype, rows, cols, n_tokens, monkeypatch):
    if isa == "torch":
        monkeypatch.setattr(qb, "native_quant", lambda: None)
    w, ref_w = _blocks(rows, cols, qtype, seed=rows + cols)
    x = torch.randn(n_tokens, cols, generator=torch.Generator().manual_seed(n_tokens)) * 3
    ref = x @ torch.from_numpy(ref_w).t()
    y = qm.quant_linear(x, w)
    assert y.shape == (n_tokens, rows) and y.dtype == torch.float32
    assert ((y - ref).abs() <= _bound(x, ref_w)).all(), float((y - ref).abs().max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_native_kernel_at_more_tokens_than_its_default(isa, qtype, monkeypatch):
    """The integer kernel takes any token count (groups of 4); the prefill switch is a speed choice."""
    if isa == "torch":
        pytest.skip("native only")
    monkeypatch.setattr(qm, "NATIVE_MAX_TOKENS", 10**6)
    w, ref_w = _blocks(96, 192, qtype)
    x = torch.randn(19, 192)
    y = qm.quant_linear(x, w)
    ref = x @ torch.from_numpy(ref_w).t()
    assert ((y - ref).abs() <= _bound(x, ref_w)).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantise_and_rows_are_exact(isa, qtype, monkeypatch):
    if isa == "torch":
        monkeypatch.setattr(qb, "native_quant", lambda: None)
    w, ref_w = _blocks(130, 96, qtype)
    assert np.array_equal(qm.dequantize_rows(w).numpy(), ref_w)
    assert np.array_equal(dequantize_blocks_torch(w.blocks, int(qtype)).numpy(), ref_w)
    ids = torch.tensor([[5, 0], [129, 5]])
    assert np.array_equal(qm.embedding(ids, w).numpy(), ref_w[ids.numpy()])
    perm = torch.randperm(130)
    assert np.array_equal(w[perm].dequantize().numpy(), ref_w[perm.numpy()])
    both = QuantTensor.cat_rows([w, w[:7]])
    assert np.array_equal(both.dequantize().numpy(), np.concatenate([ref_w, ref_w[:7]]))


def test_strided_activations_and_bf16_inputs():
    w, ref_w = _blocks(40, 64, T.Q4_1)
    x = torch.randn(3, 128)[:, ::2]  # a non-contiguous (3, 64) view
    y = qm.quant_linear(x, w)
    ref = x @ torch.from_numpy(ref_w).t()
    assert ((y - ref).abs() <= _bound(x.contiguous(), ref_w)).all()
    yb = qm.quant_linear(x.to(torch.bfloat16), w)
    assert yb.dtype == torch.bfloat16


def test_damaged_blocks_are_refused():
    w, _ = _blocks(8, 64, T.Q4_0)
    with pytest.raises(ModelFileError, match="truncated or damaged"):
        QuantTensor(w.blocks[:, :-1], int(T.Q4_0), (8, 64), "blk.0.attn_q.weight")  # a row short of a byte
    with pytest.raises(ModelFileError, match="not whole Q4_0 blocks"):
        QuantTensor.from_gguf(w.blocks.numpy()[:, :-5], int(T.Q4_0), "blk.0.attn_q.weight")
    with pytest.raises(ModelFileError, match="not whole"):
        QuantTensor(torch.zeros(8, 18, dtype=torch.uint8), int(T.Q4_0), (8, 48), "w")  # 48 columns


def test_unknown_types_are_refused():
    with pytest.raises(ModelFileError, match="type 10 is not one"):
        QuantTensor(torch.zeros(4, 84, dtype=torch.uint8), 10, (4, 256), "w")  # Q2_K
    if NAT is not None:
        y, x = torch.empty(1, 4), torch.zeros(1, 256)
        with pytest.raises(ValueError, match="unknown quantised block type 10"):
            NAT.quant_matmul(np.array([[x.data_ptr(), 10, 4, 84]]), 256, x.data_ptr(), 1, 256, y.data_ptr(), 4, 1)
        with pytest.raises(ValueError, match="w_row_bytes"):
            NAT.quant_matmul(np.array([[x.data_ptr(), 2, 4, 20]]), 32, x.data_ptr(), 1, 32, y.data_ptr(), 4, 1)


def test_bad_inputs_are_refused():
    w, _ = _blocks(8, 64, T.Q8_0)
    with pytest.raises(KernelInputError):
        qm.quant_linear(torch.randn(2, 32), w)
    with pytest.raises(KernelInputError):
        qm.embedding(torch.tensor([8]), w)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bf16_dequantisation_is_the_fp32_one_rounded(isa, qtype, monkeypatch):
    if isa == "torch":
        monkeypatch.setattr(qb, "native_quant", lambda: None)
    w, ref_w = _blocks(70, 96, qtype)
    want = torch.from_numpy(ref_w).to(torch.bfloat16)
    assert torch.equal(qm.dequantize_rows(w, dtype=torch.bfloat16), want)
    assert torch.equal(qm.dequantize_rows(w, rows=torch.tensor([69, 2]), dtype=torch.bfloat16), want[[69, 2]])


@pytest.mark.parametrize("tiles", [torch.float32, torch.bfloat16])
def test_tiles_of_many_tokens_in_either_dtype(tiles):
    """Above NATIVE_MAX_TOKENS the product is dequantised tiles and a GEMM: fp32 tiles keep the float
    reference's values to fp32's rounding; bf16 tiles (routed experts' prefill where the CPU multiplies
    bf16) round x, the weights and the products to bf16, 8 bits of mantissa each: a relative error of
    at most ~3·2^-9 per element against Σ|w||x|."""
    w, ref_w = _blocks(203, 320, T.Q4_1)
    x = torch.randn(qm.NATIVE_MAX_TOKENS + 9, 320, generator=torch.Generator().manual_seed(3))
    ref = x @ torch.from_numpy(ref_w).t()
    y = qm.quant_linear(x, w, tiles=tiles)
    scale = x.abs() @ torch.from_numpy(np.abs(ref_w)).t()  # (n, rows): Σ|w||x| per element
    assert y.dtype == torch.float32
    if tiles == torch.float32:
        assert ((y - ref).abs() <= 1e-5 * scale + 1e-6).all()
    else:
        err = (y - ref).abs() / scale
        assert float(err.max()) <= 3 * 2**-9 and float(err.max()) > 1e-6  # bf16, and not fp32 in disguise


@pytest.mark.parametrize("bf16_faster", [True, False])
def test_routed_experts_take_bf16_tiles_where_the_cpu_multiplies_bf16_faster(bf16_faster, monkeypatch):
    from engine.quant import experts as qe

    bf16_isa = NAT is not None and bool({"amx-bf16", "avx512bf16"} & set(NAT.supported_isas()))
    timed = []
    monkeypatch.setattr(qm, "_EXPERT_TILES", None)
    monkeypatch.setattr(qm, "_bf16_gemm_faster", lambda: timed.append(1) or bf16_faster)
    assert qm.expert_tiles() == (torch.bfloat16 if bf16_isa and bf16_faster else torch.float32)
    assert qm.expert_tiles() == qm.expert_tiles() and len(timed) <= 1  # timed once a process, never without bf16
    assert bool(timed) == bf16_isa
    seen = []
    real = qm.quant_linear
    monkeypatch.setattr(qe, "quant_linear", lambda *a, **kw: seen.append(kw.get("tiles", a[3:4])) or real(*a, **kw))
    gate_up, _ = _blocks(64, 96, T.Q8_0)
    down, _ = _blocks(96, 32, T.Q8_0)
    qe.swiglu_blocks(torch.randn(20, 96), gate_up, down)
    assert seen == [qm.expert_tiles()] * 2


def test_the_bf16_timing_answers_in_milliseconds():
    start = time.perf_counter()
    assert qm._bf16_gemm_faster(tokens=8, rows=64, cols=256, repeats=2) in (True, False)
    assert time.perf_counter() - start < 5.0


INTERLEAVED = NAT is not None and "avx512" in ISAS


@pytest.mark.skipif(not INTERLEAVED, reason="the interleaved one-token kernel is AVX-512's")
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("parts,cols", [((16,), 32), ((960,), 576), ((77,), 320), ((40, 24, 203), 96), ((15,), 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_interleaved_rows_match_the_row_kernel_and_gguf(qtype, parts, cols, threads):
    """A decode layer's Q4_0 / Q4_1 products read 16 rows at a time from an interleaved copy at one
    token: the same int16 activations and exact int32 block sums as the row kernel, so the two agree to
    fp32 summation order (1e-6 of Σ|w||x|), and both stay within the activation-rounding bound of
    gguf's dequantised weights. Stacked parts whose rows are no multiple of 16 (40, 24, 203) put the
    threads' chunks across groups: their edge rows take the row kernel. Under 16 rows: no copy."""
    assert NAT.select_quant_isa("avx512")
    try:
        mats = [_blocks(rows, cols, qtype, seed=rows + i) for i, rows in enumerate(parts)]
        table = np.array([[w.blocks.data_ptr(), int(qtype), w.shape[0], w.row_bytes] for w, _ in mats], dtype=np.int64)
        ref_w = np.concatenate([r for _, r in mats])
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(cols)) * 3
        n = ref_w.shape[0]
        by_rows, by_groups = torch.empty(1, n), torch.empty(1, n)
        assert NAT.quant_matmul(table, cols, x.data_ptr(), 1, cols, by_rows.data_ptr(), n, threads) == 0
        made = NAT.quant_matmul(table, cols, x.data_ptr(), 1, cols, by_groups.data_ptr(), n, threads, interleave=True)
        assert made == sum(rows >= 16 for rows in parts)
        scale = x.abs() @ torch.from_numpy(np.abs(ref_w)).t()
        assert ((by_groups - by_rows).abs() <= 1e-6 * scale + 1e-7).all(), float((by_groups - by_rows).abs().max())
        ref = x @ torch.from_numpy(ref_w).t()
        assert ((by_groups - ref).abs() <= _bound(x, ref_w)).all()
    finally:
        NAT.select_quant_isa("auto")


@pytest.mark.skipif(not INTERLEAVED, reason="the interleaved one-token kernel is AVX-512's")
def test_interleaved_copies_are_for_one_token_and_q4_only():
    """More tokens than one read the row kernel (the copy is there but unread); a Q8_0 matrix gets no
    copy. Both give the row kernel's result bit for bit."""
    for qtype, n_tokens, made in [(T.Q4_1, 3, 1), (T.Q8_0, 1, 0)]:
        w, _ = _blocks(64, 128, qtype)
        table = np.array([[w.blocks.data_ptr(), int(qtype), 64, w.row_bytes]], dtype=np.int64)
        x = torch.randn(n_tokens, 128, generator=torch.Generator().manual_seed(1))
        a, b = torch.empty(n_tokens, 64), torch.empty(n_tokens, 64)
        NAT.quant_matmul(table, 128, x.data_ptr(), n_tokens, 128, a.data_ptr(), 64, 1)
        assert NAT.quant_matmul(table, 128, x.data_ptr(), n_tokens, 128, b.data_ptr(), 64, 1, interleave=True) == made
        assert torch.equal(a, b)
