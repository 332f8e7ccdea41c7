"""Attention sinks through the hybrid KV's LSE merge (engine/kv/writescope.py, monolithic.py).

Keys split into disjoint parts, each part attended on its own (o, lse), the parts merged by their
LSE with the sink entering once, must equal one softmax over all keys with the sink in it
(attention_gpu.sdpa_with_sinks), on every path of WriteScopeKV._merge: one part, two parts
(merge_pair), several parts of one row (merge_stack), several rows with streamed chunks
(merge_groups); on each the sink scales the merged output by σ(lse − s) and does no other work on
the (B, nh, T, hs) outputs. fp32 on the CPU: reorderings only, 1e-5 on O(1) outputs.
"""

from collections import Counter
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.kernels.attention_gpu import attend_dense, sdpa_with_sinks
from engine.kv.inplace import PartitionSpec
from engine.kv.writescope import WriteScopeKV
from engine.sched.roofline import RooflineParams

NH, N_KV, HS = 4, 2, 16
ATOL = 1e-5


@pytest.fixture(scope="module")
def kv():
    spec = PartitionSpec(block_size=4, d_window=8, pingpong_tokens=8,
                         roofline=RooflineParams(A_ns_per_token=1.0, B_ns_per_token=1.0, delta_ms=0.0))
    backend = WriteScopeKV(1, N_KV, HS, max_context=64, max_batch=2, device=torch.device("cpu"),
                           dtype=torch.float32, spec=spec)
    yield backend
    backend.close()


def _case(B, T, S, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, NH, T, HS, generator=g)
    k = torch.randn(B, N_KV, S, HS, generator=g) * 2.0  # spread scores, so no part dominates trivially
    v = torch.randn(B, N_KV, S, HS, generator=g)
    sinks = torch.randn(NH, generator=g) * 2.0  # some heads give the sink most of the weight
    return q, k, v, sinks


def _reference(q, k, v, sinks):
    B, _, T, _ = q.shape
    every_key = torch.ones(B, 1, T, k.shape[2], dtype=torch.bool)  # the parts hold past keys only: no causality
    return sdpa_with_sinks(q, k, v, sinks, every_key)


def _parts(q, k, v, cuts):
    bounds = [0, *cuts, k.shape[2]]
    scale = HS ** -0.5
    return [attend_dense(q, k[:, :, a:b], v[:, :, a:b], scale) for a, b in pairwise(bounds)]


@pytest.mark.parametrize("cuts", [[], [5], [3, 9, 14]], ids=["one part", "two parts", "four parts"])
@pytest.mark.parametrize("T", [1, 3])
def test_parts_of_every_row_merge_with_the_sink_once(kv, cuts, T):
    q, k, v, sinks = _case(1, T, 20, seed=len(cuts) * 10 + T)
    plan = SimpleNamespace(seqs=[0], chunk_rows=None)
    kv._merge_rows.clear()
    out = kv._merge(plan, _parts(q, k, v, cuts), [], torch.float32, sinks)
    torch.testing.assert_close(out, _reference(q, k, v, sinks), atol=ATOL, rtol=0)
    plain = kv._merge(plan, _parts(q, k, v, cuts), [], torch.float32)  # guard: the sinks change the result
    assert (plain - out).abs().max() > 1e-2


def test_rows_with_streamed_chunks_merge_with_the_sink_once(kv):
    """Two rows: each has a part over its own keys (as the D-window), and streamed chunks that
    belong to one row each (row 0 two chunks, row 1 one), merged by row."""
    q, k, v, sinks = _case(2, 1, 24, seed=7)
    scale = HS ** -0.5
    window = attend_dense(q, k[:, :, 16:], v[:, :, 16:], scale)  # (2, nh, 1, hs): both rows
    chunks = [attend_dense(q[r:r + 1], k[r:r + 1, :, a:b], v[r:r + 1, :, a:b], scale)
              for r, (a, b) in [(0, (0, 9)), (0, (9, 16)), (1, (0, 16))]]
    plan = SimpleNamespace(seqs=[0, 1], chunk_rows=torch.tensor([0, 0, 1]))
    kv._merge_rows.clear()
    out = kv._merge(plan, [window], chunks, torch.float32, sinks)
    torch.testing.assert_close(out, _reference(q, k, v, sinks), atol=ATOL, rtol=0)


def test_monolithic_applies_the_sink_to_new_and_past_keys(tmp_path):
    """Prefill of 6 tokens, then one decode step over them: equals sdpa_with_sinks over every key."""
    from engine.kv.monolithic import MonolithicKV

    kv = MonolithicKV(1, N_KV, HS, max_context=16, max_batch=1, device=torch.device("cpu"), dtype=torch.float32)
    q, k, v, sinks = _case(1, 7, 7, seed=11)
    sid = kv.new_sequence()
    with torch.inference_mode():
        kv.begin_step([sid], 6)
        first = kv.attend(0, q[:, :, :6], k[:, :, :6], v[:, :, :6], sinks=sinks)
        kv.end_step()
        kv.begin_step([sid], 1)
        second = kv.attend(0, q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], sinks=sinks)
        kv.end_step()
    kv.close()
    torch.testing.assert_close(torch.cat([first, second], dim=2), sdpa_with_sinks(q, k, v, sinks, None),
                               atol=ATOL, rtol=0)


class _OutputOps(TorchDispatchMode):
    """Records (op, shape) of every op that yields a 4-d tensor of width HS: the (·, nh, T, hs)
    outputs and stacks of them."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[-1] == HS:
                self.ops[(str(func.overloadpacket), tuple(t.shape))] += 1
        return result


def _output_ops(kv, plan, parts, chunks, sinks):
    kv._merge_rows.clear()
    with _OutputOps() as rec:
        kv._merge(plan, parts, chunks, torch.float32, sinks)
    return rec.ops


@pytest.mark.parametrize("cuts", [[], [5], [3, 9, 14]], ids=["one part", "two parts", "four parts"])
def test_the_sink_costs_one_multiply_of_the_merged_output(kv, cuts):
    """With sinks the merge runs the ops it runs without them, plus one multiply of the merged
    (B, nh, T, hs) output: no zero-value part for the sink, no wider stack of parts."""
    q, k, v, sinks = _case(1, 1, 20, seed=3)
    plan = SimpleNamespace(seqs=[0], chunk_rows=None)
    parts = _parts(q, k, v, cuts)
    with_sinks = _output_ops(kv, plan, parts, [], sinks)
    without = _output_ops(kv, plan, parts, [], None)
    assert with_sinks - without == Counter({("aten.mul", (1, NH, 1, HS)): 1})
    assert not without - with_sinks


def test_the_sink_costs_one_multiply_with_streamed_chunks(kv):
    q, k, v, sinks = _case(2, 1, 24, seed=8)
    scale = HS ** -0.5
    window = attend_dense(q, k[:, :, 16:], v[:, :, 16:], scale)
    chunks = [attend_dense(q[r:r + 1], k[r:r + 1, :, a:b], v[r:r + 1, :, a:b], scale)
              for r, (a, b) in [(0, (0, 9)), (0, (9, 16)), (1, (0, 16))]]
    plan = SimpleNamespace(seqs=[0, 1], chunk_rows=torch.tensor([0, 0, 1]))
    with_sinks = _output_ops(kv, plan, [window], chunks, sinks)
    without = _output_ops(kv, plan, [window], chunks, None)
    assert with_sinks - without == Counter({("aten.mul", (2, NH, 1, HS)): 1})
    assert not without - with_sinks
