"""The host store: one contiguous block per expert, shared blocks for aliased experts."""

import numpy as np
import pytest
import torch

from engine.errors import ModelFileError
from engine.experts.store import ExpertStore

E, H, I = 4, 8, 6


def layer_tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)


def test_each_expert_is_one_contiguous_block_gate_up_then_down():
    gu0, dn0 = layer_tensors(0)
    gu1, dn1 = layer_tensors(1)
    store = ExpertStore.from_layers([gu0, gu1], [dn0, dn1], dtype=torch.float32)
    assert store.blocks.shape == (2 * E, 3 * H * I) and store.blocks.is_contiguous()
    assert store.layers == [0, 1] and store.n_routed == 2 * E
    for layer, (gu, dn) in enumerate([(gu0, dn0), (gu1, dn1)]):
        for e in range(E):
            block = store.block(layer, e)
            assert block.is_contiguous() and block.numel() == 3 * H * I
            assert torch.equal(block, torch.cat([gu[e].flatten(), dn[e].flatten()]))
            g, d = store.expert(layer, e)
            assert torch.equal(g, gu[e]) and torch.equal(d, dn[e])
            assert g.data_ptr() == block.data_ptr()  # views into the block, not copies
    assert store.nbytes == 2 * E * 3 * H * I * 4 and store.block_bytes == 3 * H * I * 4


def test_aliased_experts_share_one_block_and_layers_without_experts_are_skipped():
    gu, dn = layer_tensors(2)
    dense_gu, dense_dn = layer_tensors(6)
    up = dense_gu[0].unsqueeze(0).expand(E, 2 * I, H)  # the built-in upcycled layout: stride-0 copies
    down = dense_dn[0].unsqueeze(0).expand(E, H, I)
    store = ExpertStore.from_layers([None, up, gu], [None, down, dn], dtype=torch.bfloat16)
    assert store.layers == [1, 2]
    assert store.blocks.shape[0] == 1 + E  # one shared block for layer 1, E distinct for layer 2
    assert (store.block_of[0] == -1).all() and len(set(store.block_of[1].tolist())) == 1
    assert store.n_routed == 2 * E
    assert store.blocks.dtype == torch.bfloat16
    assert torch.equal(store.expert(1, 3)[0], dense_gu[0].to(torch.bfloat16))
    assert torch.equal(store.expert(2, 3)[1], dn[3].to(torch.bfloat16))


def test_empty_store_is_written_expert_by_expert():
    store = ExpertStore.empty(3, [0, 2], E, H, I, torch.float32)
    gu, dn = layer_tensors(3)
    for layer in (0, 2):
        for e in range(E):
            store.write(layer, e, gu[e] * (layer + 1), dn[e])
    assert np.array_equal(store.block_of[1], np.full(E, -1))
    assert torch.equal(store.expert(2, 1)[0], gu[1] * 3)


def test_views_are_made_once_and_see_later_writes():
    """block() and expert() hand out the same views each time (the decode path asks for them per layer
    step); they are views of the store, so a write after the first ask shows through them."""
    store = ExpertStore.empty(2, [0, 1], E, H, I, torch.float32)
    gu, dn = layer_tensors(2)
    views, block = store.expert(1, 2), store.block(1, 2)
    assert store.expert(1, 2) is views and store.block(1, 2) is block
    store.write(1, 2, gu[2], dn[2])
    assert torch.equal(views[0], gu[2]) and torch.equal(views[1], dn[2])
    assert block.data_ptr() == views[0].data_ptr() and store.expert(0, 2) is not views


def test_mismatched_shapes_are_refused():
    gu, dn = layer_tensors(4)
    with pytest.raises(ModelFileError, match="do not match"):
        ExpertStore.from_layers([gu, gu], [dn, dn[:, :, :3]], dtype=torch.float32)
    with pytest.raises(ModelFileError, match="no routed experts"):
        ExpertStore.from_layers([None], [None], dtype=torch.float32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_store_is_pinned_exactly_and_unpinned_on_close():
    gu, dn = layer_tensors(5)
    store = ExpertStore.from_layers([gu], [dn], dtype=torch.bfloat16, pin=True)
    assert store.pinned and store.blocks.is_pinned()
    slot = torch.empty(store.block_numel, dtype=torch.bfloat16, device="cuda")
    slot.copy_(store.block(0, 1), non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(slot.cpu(), store.block(0, 1))
    store.close()
    assert not store.pinned and not store.blocks.is_pinned()


def test_moe_table_rows_point_at_each_experts_views():
    """The native call's table rows for a layer's experts hold the addresses and row strides of the
    same gate_up and down views `expert` hands out, aliased blocks included, and are a fresh array
    the caller may fill."""
    gu0, dn0 = layer_tensors(0)
    shared_gu, shared_dn = gu0[1:2].expand(E, 2 * I, H), dn0[1:2].expand(E, H, I)  # layer 2: one block for all
    store = ExpertStore.from_layers([gu0, None, shared_gu], [dn0, None, shared_dn], dtype=torch.bfloat16)
    for layer in (0, 2):
        experts = np.array([3, 0, 2], dtype=np.int64)
        table = store.moe_table(layer, experts)
        assert table.shape == (3, 5) and table.dtype == np.int64
        for row, e in zip(table, experts):
            g, d = store.expert(layer, int(e))
            assert row.tolist() == [g.data_ptr(), d.data_ptr(), g.stride(0), d.stride(0), 0]
        table[:, 4] = 7
        assert (store.moe_table(layer, experts)[:, 4] == 0).all()
