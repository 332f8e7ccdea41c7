"""The resident KV reads one sequence's keys in place (a slice of the cache) when its blocks are
consecutive, and gathers them otherwise; both attend exactly like SDPA over the sequence's keys."""

import torch
import torch.nn.functional as F

from engine.kv.resident import ResidentKV

N_KV, NH, HS, BS = 2, 4, 16, 8


def _kv(max_batch: int = 1) -> ResidentKV:
    return ResidentKV(1, N_KV, HS, max_context=64, max_batch=max_batch, block_size=BS,
                      device=torch.device("cpu"), dtype=torch.float32, paged_decode=False)


def _run(kv: ResidentKV, sid: int, n_prompt: int, n_decode: int, g: torch.Generator) -> list[tuple]:
    """Prefill n_prompt tokens then decode n_decode, one at a time → per decode step (read, out, ref)."""
    past_k, past_v, steps = [], [], []
    for n_new in [n_prompt] + [1] * n_decode:
        kv.begin_step([sid], n_new)
        q = torch.randn(1, NH, n_new, HS, generator=g)
        k, v = (torch.randn(1, N_KV, n_new, HS, generator=g) for _ in range(2))
        read = kv._step[3]
        out = kv.attend(0, q, k, v)
        kv.end_step()
        past_k.append(k)
        past_v.append(v)
        if n_new == 1:
            keys, values = torch.cat(past_k, 2), torch.cat(past_v, 2)  # (1, n_kv, S, hs)
            ref = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
            steps.append((read, out, ref))
    return steps


def test_a_sequence_on_consecutive_blocks_is_read_in_place():
    kv, g = _kv(), torch.Generator().manual_seed(0)
    steps = _run(kv, kv.new_sequence(), 13, 12, g)  # the decode crosses two block boundaries
    for read, out, ref in steps:
        assert isinstance(read, slice)  # no gather: a view of the cache
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_sequence_on_scattered_blocks_is_gathered_and_still_exact():
    kv, g = _kv(max_batch=3), torch.Generator().manual_seed(1)
    first, second = kv.new_sequence(), kv.new_sequence()
    kv.begin_step([first], BS)  # the first sequence takes block 0
    kv.attend(0, *(torch.randn(1, h, BS, HS, generator=g) for h in (NH, N_KV, N_KV)))
    kv.end_step()
    kv.begin_step([second], BS)  # the second takes block 1
    kv.attend(0, *(torch.randn(1, h, BS, HS, generator=g) for h in (NH, N_KV, N_KV)))
    kv.end_step()
    third = kv.new_sequence()
    kv.free(first)  # block 0 is free again, ahead of the blocks after 1
    steps = _run(kv, third, BS + 3, 8, g)  # blocks 0 and 2 (or later): not consecutive
    assert any(not isinstance(read, slice) for read, _, _ in steps)
    for _, out, ref in steps:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
