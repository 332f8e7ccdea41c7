"""engine/kernels/cuda_streams.py: devices with their index, stream switches that return where told,
small host tensors copied to the GPU without a wait."""

import pytest
import torch

from engine.kernels.cuda_streams import Switch, indexed, to_device_async


def test_cpu_devices_pass_through():
    assert indexed("cpu") == torch.device("cpu")
    assert indexed(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_gets_the_current_index_and_switch_returns():
    dev = indexed("cuda")
    assert dev.index == torch.cuda.current_device() and indexed(dev) == dev
    home, side = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)
    with Switch(side, home):
        assert torch.cuda.current_stream(dev) == side
        x = torch.ones(4, device=dev) * 2  # queued on the side stream
    assert torch.cuda.current_stream(dev) == home
    home.wait_stream(side)
    assert x.sum().item() == 8


def test_to_device_async_on_the_cpu_is_a_plain_copy():
    t = torch.arange(5)
    assert torch.equal(to_device_async(t, torch.device("cpu")), t)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_device_async_does_not_wait_for_the_gpu():
    to_device_async(torch.arange(3), torch.device("cuda"))  # the pinned pool's first block outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = to_device_async(torch.arange(5), torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got.device.type == "cuda" and got.tolist() == [0, 1, 2, 3, 4]
