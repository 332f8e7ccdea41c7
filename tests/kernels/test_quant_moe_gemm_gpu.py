"""The prefill GEMMs over GGUF-quantised experts (engine/kernels/quant_moe_gemm_gpu.py) against the same
experts dequantised on the CPU (`QuantLayout.dequantize`'s fp32 values): in fp32 through the torch
reference, in bf16 through the decode kernels, whose roundings are in the same places. Every kept type in all three parts, mixed layouts with
rows and columns that end inside a tile, fp32 and bf16 activations, experts whose pairs fill more than
one block of rows, experts outside the pool. Interpreted on CPU tensors here (tests/conftest.py sets
TRITON_INTERPRET=1 without CUDA); compiled on CUDA with `-m cuda`.

The pool's unused rows and each row's padding are 0xFF bytes (NaN factors, tests/kernels/
test_quant_moe_gpu.py's `slots`): one read of them shows as a NaN in the output.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

pytest.importorskip("triton")

from test_quant_moe_gpu import CUDA, DEVICES, TYPES, close_fp32, on, slots  # noqa: E402

from engine.kernels import moe_decode_gpu, quant_moe_gemm_gpu  # noqa: E402
from engine.kernels.experts_torch import moe_experts  # noqa: E402

S = 6  # pool rows: 1 … 4 hold experts, 0 and 5 are junk
ROW_OF = [3, 1, 4, 2, 6, -1]  # expert → pool row; experts 4 and 5 are computed elsewhere


def run(types, H: int, I: int, N: int, k: int, dtype, device, seed: int, form=None):
    """N tokens routed to k of the 6 experts, expert 1 chosen by most tokens (more pairs than a block of
    rows) → (moe_prefill_quant's out, the reference's, both fp32 on the CPU; the experts chosen)."""
    pool, parts, dense = slots(types, H, I, S, [1, 2, 3, 4], seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.cat([torch.tensor([1]), 2 + torch.randperm(4, generator=gen)[:k - 1]])
                       if t % 4 else torch.randperm(6, generator=gen)[:k] for t in range(N)])  # (N, k)
    x = torch.randn(N, H, generator=gen).to(device, dtype)
    w = torch.softmax(torch.randn(N, k, generator=gen), -1).to(device, dtype)
    row_of = torch.tensor(ROW_OF, device=device)
    got = quant_moe_gemm_gpu.moe_prefill_quant(x, ids.to(device), w, pool.to(device), parts, I, row_of, form)
    assert got.dtype == torch.float32 and got.shape == (N, H)
    if dtype == torch.float32:  # the torch reference over each expert's row (fast where interpreted)
        inside = torch.tensor([r in range(S) for r in ROW_OF])  # (E,)
        rows = torch.where(inside, torch.tensor(ROW_OF), 1)  # an outside expert's pairs weigh zero below
        want = moe_experts(x.cpu(), ids, w.cpu() * inside[ids], dense[rows, :2 * I * H].unflatten(1, (2 * I, H)),
                           dense[rows, 2 * I * H:].unflatten(1, (H, I)))
    else:  # the decode kernels, whose roundings are the same (rows outside [0, S): skipped)
        dense = dense.to(device)
        want = moe_decode_gpu.moe_decode(x, row_of[ids.to(device)], w, dense[:, :2 * I * H].unflatten(1, (2 * I, H)),
                                         dense[:, 2 * I * H:].unflatten(1, (H, I)))
    return got.cpu(), want.cpu().float(), ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_in_all_three_parts(qtype, device):
    device = on(device)
    got, want, _ = run((qtype,) * 3, 256, 256, 12, 2, torch.float32, device, seed=int(qtype))
    close_fp32(got, want)


@pytest.mark.parametrize("device,dtype", [
    pytest.param("cpu", torch.float32, id="cpu-fp32"), pytest.param("cuda", torch.float32, marks=CUDA, id="cuda-fp32"),
    # bf16 on the GPU only: Triton's interpreter multiplies bf16 tiles wrongly (outputs of 1e11)
    pytest.param("cuda", torch.bfloat16, marks=CUDA, id="cuda-bf16")])
@pytest.mark.parametrize("types,H,I", [
    ((T.Q4_K, T.Q4_K, T.Q6_K), 512, 256),  # a Q4_K_M layer: down in Q6_K
    # H = 320 and I = 96 end inside a K step (10 and 3 sub-blocks, 2 a step) and I inside a row tile
    ((T.Q8_0, T.Q4_1, T.MXFP4), 320, 96),
], ids=["Q4_K-Q4_K-Q6_K", "Q8_0-Q4_1-MXFP4"])
def test_mixed_layouts_and_groups_of_several_blocks(types, H, I, dtype, device):
    """Expert 1 takes 3 of every 4 tokens: 1.5 blocks of rows, so two blocks; tokens routed only to
    experts outside the pool come out exactly zero."""
    device = on(device)
    got, want, ids = run(types, H, I, 2 * quant_moe_gemm_gpu.BM, 3, dtype, device, seed=H + I)
    assert int((ids == 1).sum()) > quant_moe_gemm_gpu.BM
    if dtype == torch.float32:
        close_fp32(got, want)
    else:
        # bf16: the same roundings in the same places as the decode kernels (gate, up, SiLU, act, y), so a
        # difference comes only from an fp32 sum landing on the other side of a bf16 rounding (2^-8
        # relative) of one gate, up or y, carried through SiLU·up and down
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    outside = torch.tensor([all(ROW_OF[int(e)] not in range(S) for e in row) for row in ids])
    assert torch.equal(got[outside], torch.zeros(int(outside.sum()), H))


@pytest.mark.parametrize("device", DEVICES)
def test_gpt_oss_form(device):
    """Each pair adds its expert's biases and takes the clamped SwiGLU, against the decode kernels."""
    from engine.kernels.experts_torch import ClampedSwiGLU

    device = on(device)
    H = I = 256
    g = torch.Generator().manual_seed(9)
    form = ClampedSwiGLU(torch.randn(S, 2 * I, generator=g).to(device), torch.randn(S, H, generator=g).to(device),
                         alpha=1.702, limit=0.5)
    pool, parts, dense = slots((T.MXFP4, T.MXFP4, T.Q8_0), H, I, S, [1, 2, 3, 4], seed=2)
    ids = torch.tensor([[0, 1], [1, 3], [2, 4], [3, 0], [1, 2]], device=device)
    x = torch.randn(5, H, generator=g).to(device)
    w = torch.softmax(torch.randn(5, 2, generator=g), -1).to(device)
    row_of = torch.tensor(ROW_OF, device=device)
    got = quant_moe_gemm_gpu.moe_prefill_quant(x, ids, w, pool.to(device), parts, I, row_of, form)
    from engine.kernels import quant_moe_gpu

    want = quant_moe_gpu.moe_decode_quant(x, row_of[ids], w, pool.to(device), parts, I, form=form, experts=ids)
    close_fp32(got.cpu(), want.cpu())


def test_pairs_are_grouped_into_padded_blocks_of_one_expert():
    ids = torch.tensor([[2, 0], [2, 5], [0, 2], [4, 2]])  # expert 5's row is outside the pool
    row_of = torch.tensor([7, 1, 0, 3, 2, 9])  # 8 rows: experts 0 … 4 inside
    pair_of, block_expert, used = quant_moe_gemm_gpu._align(ids, row_of, 8, bm=2)
    assert pair_of.shape[0] % 2 == 0 and pair_of.shape[0] >= int(used)
    assert int(used) == 2 + 4 + 2  # expert 0: 2 pairs; 2: 4 pairs; 4: 1 pair padded to 2
    rows = pair_of[:int(used)].view(-1, 2)
    assert block_expert[:rows.shape[0]].tolist() == [0, 2, 2, 4]
    flat = ids.reshape(-1)
    for b, (expert, pairs) in enumerate(zip(block_expert.tolist(), rows.tolist())):
        real = [p for p in pairs if p >= 0]
        assert real and all(int(flat[p]) == expert for p in real), b
    assert sorted(p for p in pair_of.tolist() if p >= 0) == [p for p in range(8) if int(flat[p]) != 5]


def test_misshapen_arguments_are_refused():
    pool, parts, _ = slots((T.Q4_0,) * 3, 64, 32, 2, [1], seed=1)
    x, ids, w = torch.zeros(2, 64), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    with pytest.raises(ValueError, match="row_of"):
        quant_moe_gemm_gpu.moe_prefill_quant(x, ids, w, pool, parts, 32, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="ids must be"):
        quant_moe_gemm_gpu.moe_prefill_quant(x, ids.int(), w, pool, parts, 32, torch.zeros(4, dtype=torch.int64))
