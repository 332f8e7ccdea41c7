"""The decode GEMVs over GGUF-quantised expert slots (engine/kernels/quant_moe_gpu.py) against the bf16
decode kernels (engine/kernels/moe_decode_gpu.py) run over the same slots dequantised on the CPU
(`QuantLayout.dequantize`: gguf's values in fp32): every kept type in all three parts, mixed layouts,
fp32 and bf16 activations, slots out of order and repeated, skipped pairs, slot rows with the parts at
gaps and padding after them. Interpreted on CPU tensors here (tests/conftest.py sets
TRITON_INTERPRET=1 without CUDA); compiled on CUDA with `-m cuda`.

Bytes the kernels must not read are 0xFF (fp16 NaN factors, MXFP4 scales of 2^127): the unused slots
(0 among them, where a skipped pair's id is clamped for its masked address) and the padding of each
slot row. One NaN read from them shows in the output.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

pytest.importorskip("triton")

from test_dequant_gpu import random_blocks  # noqa: E402

from engine.experts.store import QuantLayout  # noqa: E402
from engine.kernels import dequant_gpu, moe_decode_gpu, quant_moe_gpu  # noqa: E402
from engine.quant.blocks import QTYPES  # noqa: E402

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.Q4_K, T.Q5_K, T.Q6_K]
# fp16 factors (byte offset: size) that keep the weights O(0.1) whatever the random integers (Q4_K:
# d·63·15 ≈ 0.1, Q6_K: d·128·32 ≈ 0.1, ...), so gate, up and the SiLU stay where both dtypes resolve them
SIZES = {T.Q4_0: {0: 0.01}, T.Q4_1: {0: 0.01, 2: 0.05}, T.Q5_0: {0: 6e-3}, T.Q5_1: {0: 3e-3, 2: 0.05},
         T.Q8_0: {0: 1e-3}, T.MXFP4: {}, T.Q4_K: {0: 1e-4, 2: 1e-4}, T.Q5_K: {0: 5e-5, 2: 1e-4},
         T.Q6_K: {208: 2.5e-5}}
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=CUDA)]
LEAD, GAP, TAIL = 16, 8, 37  # junk bytes before gate, between gate and up, after down in a slot row


def on(device: str) -> torch.device:
    if device == "cpu" and not dequant_gpu.interpreted():
        pytest.skip("CPU tensors need Triton's interpreter (set where there is no CUDA)")
    return torch.device(device)


def expert_blocks(rows: int, cols: int, qtype, seed: int) -> np.ndarray:
    """(rows, row bytes) uint8 of `qtype`: random_blocks' bytes with the factors rescaled to SIZES (and
    MXFP4's exponent byte to 2^-9 … 2^-5 scales)."""
    qt, rng = QTYPES[int(qtype)], np.random.default_rng(seed + 1)
    data = random_blocks(rows, cols, qtype, seed).reshape(rows, -1, qt.block_bytes)
    shape = data.shape[:2]
    if qtype == T.MXFP4:
        data[:, :, 0] = rng.integers(119, 124, shape)  # ×2^(e − 128) on doubled codes ≤ 12: |w| ≤ 0.375
    for at, size in SIZES[qtype].items():
        h = (rng.uniform(0.2, 1.0, shape) * size * rng.choice([-1, 1], shape)).astype(np.float16)
        data[:, :, at:at + 2] = h.view(np.uint8).reshape(*shape, 2)
    return data.reshape(rows, -1)


def slots(types, H: int, I: int, S: int, used: list[int], seed: int):
    """S slots of experts in `types` (gate, up, down), only `used` holding blocks → (pool (S, B) uint8 with
    the parts at LEAD, after a GAP, then down and TAIL padding; parts; the fp32 pool (S, 3IH) that
    moe_decode reads, NaN where unused)."""
    layout = QuantLayout(tuple(int(t) for t in types), H, I)
    blocks = torch.zeros(S, layout.nbytes, dtype=torch.uint8)
    for p, (code, rows, cols, at, nbytes) in enumerate(layout.parts):
        blocks[:, at:at + nbytes] = torch.from_numpy(expert_blocks(S * rows, cols, T(code), seed + p).reshape(S, -1))
    (g, _, _, _, ng), (u, _, _, _, nu), (d, *_) = layout.parts
    parts = ((g, LEAD), (u, LEAD + ng + GAP), (d, LEAD + ng + GAP + nu))
    pool = torch.full((S, layout.nbytes + LEAD + GAP + TAIL), 0xFF, dtype=torch.uint8)
    pool[used, LEAD:LEAD + ng] = blocks[used, :ng]
    pool[used, LEAD + ng + GAP:-TAIL] = blocks[used, ng:]
    dense = torch.full((S, 3 * I * H), float("nan"))
    dense[used] = layout.dequantize(blocks[used])  # (n, 3IH): [gate_up (2I·H) | down (H·I)], gguf's values
    return pool, parts, dense


def run(types, H: int, I: int, ids: list[list[int]], dtype, device, seed: int):
    """ids (N, k) over 6 slots (1 … 4 hold experts; 0, 5 are junk) → (moe_decode_quant's out, moe_decode's
    over the dequantised slots), both on the CPU in fp32."""
    S = 6
    pool, parts, dense = slots(types, H, I, S, [1, 2, 3, 4], seed)
    gen = torch.Generator().manual_seed(seed)
    N, k = len(ids), len(ids[0])
    x = torch.randn(N, H, generator=gen).to(device, dtype)
    w = torch.softmax(torch.randn(N, k, generator=gen), -1).to(device, dtype)
    ids_t = torch.tensor(ids, device=device)
    got = quant_moe_gpu.moe_decode_quant(x, ids_t, w, pool.to(device), parts, I)
    dense = dense.to(device)
    want = moe_decode_gpu.moe_decode(x, ids_t, w, dense[:, :2 * I * H].unflatten(1, (2 * I, H)),
                                     dense[:, 2 * I * H:].unflatten(1, (H, I)))
    assert got.dtype == dtype and got.shape == (N, H)
    return got.cpu().float(), want.cpu().float()


# fp32: the two compute the same fp32 products of the same weights; only the order of the fp32 sums
# differs (sub-blocks of 32 summed, then 8 of them, against 1024-wide tl.sum's), a few 2^-24 of the
# Σ|w·x| behind each value, well under 1e-4 of the largest output.
def close_fp32(got, want):
    assert torch.isfinite(want).all()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_in_all_three_parts(qtype, device):
    device = on(device)
    got, want = run((qtype,) * 3, 256, 256, [[3, 6, 1]], torch.float32, device, seed=int(qtype))  # 6: skipped
    close_fp32(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("types,H,I,ids", [
    # a Q4_K_M layer: down in Q6_K; H = 512 walks two steps of 8 sub-blocks along gate and up
    ((T.Q4_K, T.Q4_K, T.Q6_K), 512, 256, [[4, 2], [2, -1], [1, 4]]),
    # three 32-weight types; H = 320 and I = 96 end in part steps (10 and 3 sub-blocks of 8) and I a part tile
    ((T.Q8_0, T.Q4_1, T.MXFP4), 320, 96, [[2, 2, 6, 1], [-1, 6, 6, -1], [4, 3, 1, 2]]),
], ids=["Q4_K-Q4_K-Q6_K", "Q8_0-Q4_1-MXFP4"])
def test_mixed_layouts(types, H, I, ids, dtype, device):
    """Slots out of order and repeated (within a token too), skipped pairs (6 = S, −1) add zero, a token
    with every pair skipped is exactly zero."""
    device = on(device)
    got, want = run(types, H, I, ids, dtype, device, seed=H + I)
    if dtype == torch.float32:
        close_fp32(got, want)
    else:
        # bf16: the same roundings in the same places (gate, up, SiLU, act, y, y·w), so a difference comes
        # only from an fp32 sum landing on the other side of a bf16 rounding, a bf16 step (2^-8 relative)
        # of one gate, up or y, carried through SiLU·up and down: a few steps of the largest output at most
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    for t, row in enumerate(ids):
        if all(s in (-1, 6) for s in row):
            assert torch.equal(got[t], torch.zeros(H))


@pytest.mark.parametrize("device", DEVICES)
def test_the_gpus_tiles_in_the_interpreter(monkeypatch, device):
    """The GPU's tile sizes (4 and 8 rows a program) rather than the interpreter's tall ones, out= written."""
    device = on(device)
    monkeypatch.setattr(quant_moe_gpu.dequant_gpu, "interpreted", lambda: False)
    got, want = run((T.Q5_K, T.Q4_0, T.Q6_K), 256, 256, [[2, 4]], torch.float32, device, seed=5)
    close_fp32(got, want)
    pool, parts, _ = slots((T.Q5_1, T.Q5_0, T.Q8_0), 64, 32, 3, [1], seed=6)
    x = torch.randn(1, 64, device=device)
    out = torch.full_like(x, float("nan"))
    ids, w = torch.tensor([[1, 3]], device=device), torch.ones(1, 2, device=device)
    assert quant_moe_gpu.moe_decode_quant(x, ids, w, pool.to(device), parts, 32, out=out) is out
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_pairs_read_nothing(device):
    """Every pair skipped, slot 0 (where their addresses are clamped) junk: the output is exactly zero."""
    device = on(device)
    pool, parts, _ = slots((T.Q4_K, T.Q8_0, T.MXFP4), 256, 256, 2, [1], seed=7)
    x = torch.randn(2, 256, device=device, dtype=torch.bfloat16)
    ids = torch.tensor([[-1, 2], [2, -5]], device=device)
    w = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
    assert torch.equal(quant_moe_gpu.moe_decode_quant(x, ids, w, pool.to(device), parts, 256).cpu(),
                       torch.zeros(2, 256, dtype=torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("types", [(T.MXFP4,) * 3, (T.Q8_0, T.Q4_1, T.Q6_K)], ids=["MXFP4", "Q8_0-Q4_1-Q6_K"])
def test_gpt_oss_form_adds_each_experts_biases_and_clamps(types, device):
    """ClampedSwiGLU over slots: each pair's biases come from its expert id (`experts`), not its slot;
    the clamped activation; skipped pairs (slot 6 = S, −1) add nothing, their expert ids junk. fp32:
    only the order of the sums differs from the reference."""
    from engine.kernels.experts_torch import ClampedSwiGLU

    device = on(device)
    H, I = 256, 256
    pool, parts, dense = slots(types, H, I, 6, [1, 2, 3, 4], seed=9)
    g = torch.Generator().manual_seed(9)
    n_experts = 10
    form = ClampedSwiGLU(torch.randn(n_experts, 2 * I, generator=g), torch.randn(n_experts, H, generator=g),
                         alpha=1.702, limit=0.5)  # a limit the gate and up values cross
    slot_ids = torch.tensor([[3, 1], [6, 2], [4, -1]])
    experts = torch.tensor([[7, 0], [99, 5], [2, -4]])  # expert ids of the pairs (junk where skipped)
    x = torch.randn(3, H, generator=g)
    w = torch.softmax(torch.randn(3, 2, generator=g), -1)
    on_device = ClampedSwiGLU(form.gate_up_bias.to(device), form.down_bias.to(device), form.alpha, form.limit)
    got = quant_moe_gpu.moe_decode_quant(x.to(device), slot_ids.to(device), w.to(device), pool.to(device), parts, I,
                                         form=on_device, experts=experts.to(device)).cpu()
    want = torch.zeros(3, H)
    for t in range(3):
        for j in range(2):
            s, e = int(slot_ids[t, j]), int(experts[t, j])
            if not 0 <= s < 6:
                continue
            gate_up, down = dense[s, :2 * I * H].view(2 * I, H), dense[s, 2 * I * H:].view(H, I)
            want[t] += w[t, j] * form.ffn(x[t:t + 1], e, gate_up, down)[0]
    close_fp32(got, want)


def test_misshapen_arguments_are_refused():
    pool, parts, _ = slots((T.Q4_0, T.Q4_0, T.Q4_0), 64, 32, 2, [1], seed=8)  # B = 3·1,152 + junk bytes
    x, ids, w = torch.zeros(1, 64), torch.tensor([[1, 0]]), torch.ones(1, 2)

    def call(x=x, ids=ids, w=w, pool=pool, parts=parts, I=32, out=None):
        quant_moe_gpu.moe_decode_quant(x, ids, w, pool, parts, I, out=out)

    with pytest.raises(ValueError, match="int64"):
        call(ids=ids.int())
    with pytest.raises(ValueError, match=r"\(1, k\) int64"):
        call(ids=ids.reshape(2, 1))
    with pytest.raises(ValueError, match="weights must be"):
        call(w=w.double())
    with pytest.raises(ValueError, match="x must be"):
        call(x=x.double())
    with pytest.raises(ValueError, match="uint8"):
        call(pool=pool.view(torch.int8))
    with pytest.raises(ValueError, match="contiguous rows"):
        call(pool=pool.t().contiguous().t())
    with pytest.raises(ValueError, match="do not fit"):
        call(pool=pool[:, :-40])  # down runs past the row
    with pytest.raises(ValueError, match="do not fit"):
        call(parts=(parts[0], parts[1], (parts[2][0], -1)))
    with pytest.raises(ValueError, match="not whole Q4_K blocks of 256"):
        call(parts=((int(T.Q4_K), 0), parts[1], parts[2]))  # H = 64
    with pytest.raises(ValueError, match="not one of the kept"):
        call(parts=(parts[0], (1, parts[1][1]), parts[2]))  # F16
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.zeros(1, 64, dtype=torch.bfloat16))


def test_available_needs_cuda_or_the_interpreter():
    assert quant_moe_gpu.available(torch.zeros(1, 8)) == dequant_gpu.interpreted()
