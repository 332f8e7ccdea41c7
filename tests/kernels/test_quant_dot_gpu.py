"""The int16 form of the activations the decode GEMVs multiply (engine/kernels/quant_dot_gpu.py): the
values, scales and half-block sums against a torch reference, a block of zeros, the packing of two
values a word; and the blocks' alignment the 16-bit reads need. Interpreted on CPU tensors here;
compiled on CUDA with `-m cuda` (where the quantiser's division may put a value one step the other way).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

pytest.importorskip("triton")

from test_quant_moe_gpu import DEVICES, on, q16, slots  # noqa: E402

from engine.kernels import quant_dot_gpu, quant_moe_gpu  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_activations_become_int16_steps_of_a_blocks_largest_over_32767(dtype, device):
    device = on(device)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 96, generator=g) * torch.tensor([1.0, 1e-3, 50.0]).repeat_interleave(32)).to(dtype)
    x[1, 32:64] = 0  # a block of zeros: scale 0, values 0
    words, scales, sums = quant_dot_gpu.quantize_rows(x.to(device))
    assert words.shape == (3, 48) and scales.shape == (3, 3) and sums.shape == (3, 6)
    values = words.cpu().view(torch.int16).view(3, 96).float()  # little-endian: value 2t + i is half i of word t
    blocks = x.float().unflatten(1, (3, 32))
    want_scales = blocks.abs().amax(-1) / 32767
    assert torch.allclose(scales.cpu(), want_scales, rtol=1e-6, atol=0)
    assert values.abs().max() <= 32767
    assert (values.unflatten(1, (3, 32)).abs().amax(-1)[want_scales > 0] == 32767).all()
    steps = 0 if device.type == "cpu" else 1  # the GPU's 32767 / amax is not correctly rounded
    assert ((values * scales.cpu().repeat_interleave(32, 1) - q16(x)).abs()
            <= (steps + 1e-3) * scales.cpu().repeat_interleave(32, 1)).all()
    assert torch.equal(sums.cpu(), values.view(3, 6, 16).sum(-1).int())
    assert (values[1, 32:64] == 0).all() and scales[1, 1] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_odd_offsets_are_refused_except_for_mxfp4(device):
    """Q8_0's 16-bit words at an odd slot stride would be misaligned loads on a GPU; MXFP4 reads bytes."""
    device = on(device)
    x, ids, w = torch.randn(1, 64), torch.tensor([[1]]), torch.ones(1, 1)
    pool, parts, _ = slots((T.Q8_0,) * 3, 64, 32, 2, [1], seed=2)
    odd = torch.zeros(2, pool.shape[1] + 1, dtype=torch.uint8)
    odd[:, :-1] = pool
    with pytest.raises(ValueError, match="16 bits at a time; odd slot_stride"):
        quant_moe_gpu.moe_decode_quant(x.to(device), ids.to(device), w.to(device), odd.to(device), parts, 32)
    with pytest.raises(ValueError, match="odd offset"):
        quant_moe_gpu.moe_decode_quant(x.to(device), ids.to(device), w.to(device), pool.to(device),
                                       (parts[0], (parts[1][0], parts[1][1] + 1), parts[2]), 32)
    pool, parts, _ = slots((T.MXFP4,) * 3, 64, 32, 2, [1], seed=2)
    odd = torch.zeros(2, pool.shape[1] + 1, dtype=torch.uint8)
    odd[:, :-1] = pool
    out = quant_moe_gpu.moe_decode_quant(x.to(device), ids.to(device), w.to(device), odd.to(device), parts, 32)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("types", [(T.Q4_K, T.Q5_K, T.Q4_1), (T.Q5_1, T.Q4_K, T.Q6_K)], ids=lambda t: "-".join(
    x.name for x in t))
def test_32_bit_words_where_slots_are_aligned_give_what_16_bit_ones_give(types, device):
    """The same slots at a row stride of 4k + 2 (16-bit words) and of 4k (the aligned types' parts read
    32-bit words): the same outputs, bit for bit; a part of another type (Q6_K) keeps 16-bit words."""
    device = on(device)
    pool, parts, _ = slots(types, 256, 256, 3, [1, 2], seed=4)
    wide = torch.full((3, pool.shape[1] + 2), 0xFF, dtype=torch.uint8)
    wide[:, :-2] = pool
    x, w = torch.randn(2, 256), torch.softmax(torch.randn(2, 2), -1)
    ids = torch.tensor([[1, 2], [2, 1]])
    assert pool.stride(0) % 4 == 2 and wide.stride(0) % 4 == 0  # slots of 4k + 2 bytes, then of 4k
    outs = [quant_moe_gpu.moe_decode_quant(x.to(device), ids.to(device), w.to(device), p.to(device), parts, 256).cpu()
            for p in (pool, wide)]
    assert quant_dot_gpu.aligned(int(types[0]), 16, wide.stride(0)) and not quant_dot_gpu.aligned(int(types[0]), 18)
    assert not quant_dot_gpu.aligned(int(T.Q6_K), 0)
    assert torch.equal(outs[0], outs[1])
