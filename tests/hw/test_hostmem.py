"""Large host regions on transparent huge pages (engine/hw/hostmem.py)."""

import gc
import mmap
from pathlib import Path

import pytest
import torch

from engine.experts.store import ExpertStore
from engine.hw.hostmem import HUGE_PAGE, PAGE, huge_page_bytes, huge_page_eligible, large_host_tensor, touched


def thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0]


needs_thp = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or thp_mode() in (None, "never"),
                               reason="no transparent huge pages on this system")


@needs_thp
def test_a_large_region_is_aligned_eligible_for_huge_pages_and_outlives_its_mapping_object():
    t = large_host_tensor((3, HUGE_PAGE // 2 + 5), torch.bfloat16)  # 3 MiB and a bit: not whole huge pages
    assert t.shape == (3, HUGE_PAGE // 2 + 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert huge_page_eligible(t) is True
    gc.collect()  # only the tensor holds the mapping now
    t.fill_(3)
    t[-1, -1] = 7
    assert t.float().sum().item() == 3 * (3 * (HUGE_PAGE // 2 + 5)) + 4


def test_small_regions_and_kernels_without_huge_pages_take_ordinary_memory(monkeypatch):
    """No mapping of their own: asked of smaps, where malloc put a small tensor decides the answer (it
    sometimes lands in an eligible mapping), so the test forbids the mapping instead."""
    import engine.hw.hostmem as hostmem

    def no_mapping(*args, **kwargs):
        raise AssertionError("a huge-page mapping was made")

    monkeypatch.setattr(hostmem.mmap, "mmap", no_mapping)
    small = large_host_tensor((1000,), torch.float32)  # under one huge page
    assert small.shape == (1000,) and small.dtype == torch.float32
    monkeypatch.delattr(hostmem.mmap, "MADV_HUGEPAGE", raising=False)
    assert large_host_tensor((HUGE_PAGE,), torch.uint8).numel() == HUGE_PAGE


@needs_thp
def test_touched_buffers_are_committed_page_aligned_and_on_huge_pages_when_large():
    small, large = touched(PAGE + 10), touched(2 * HUGE_PAGE, torch.float32)
    assert small.data_ptr() % PAGE == 0 and (small == 1).all()
    assert large.numel() == 2 * HUGE_PAGE // 4 and large.data_ptr() % HUGE_PAGE == 0
    assert (large.view(torch.uint8) == 1).all() and huge_page_eligible(large) is True


@needs_thp
def test_the_expert_store_holds_its_blocks_on_huge_pages_and_says_so():
    E, H, I = 4, 256, 512  # 4 experts × 1.5 MiB in fp32: 6 MiB
    gu, dn = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    store = ExpertStore.from_layers([gu], [dn], dtype=torch.float32)
    assert store.huge_pages is True and huge_page_eligible(store.blocks) is True
    g, d = store.expert(0, 3)
    assert torch.equal(g, gu[3]) and torch.equal(d, dn[3])


@needs_thp
def test_huge_page_bytes_counts_within_the_mapping():
    t = large_host_tensor((4 * HUGE_PAGE,), torch.uint8)
    t.fill_(1)  # commits the pages (huge ones, unless memory is too fragmented to find any)
    held = huge_page_bytes(t)
    assert held is not None and 0 <= held <= 5 * HUGE_PAGE and held % HUGE_PAGE == 0


@needs_thp
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pinned_store_on_huge_pages_copies_to_the_device_and_maps_for_zero_copy_reads():
    from engine.hw.hostmem import device_address

    E, H, I = 6, 256, 512  # 6 experts × 1.5 MiB in fp32
    gu, dn = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    store = ExpertStore.from_layers([gu], [dn], dtype=torch.float32, pin=True)
    assert store.pinned and store.huge_pages
    for e in range(E):
        block = store.block(0, e)
        on_device = block.to("cuda", non_blocking=True)  # a DMA from the registered huge pages
        torch.cuda.synchronize()
        assert torch.equal(on_device.cpu(), block)
    assert device_address(store.blocks) != 0  # registered and mapped: the one graph reads it in place
