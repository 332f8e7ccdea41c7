"""engine/kernels/cuda_streams.py: devices with their index, stream switches that return where told."""

import pytest
import torch

from engine.kernels.cuda_streams import Switch, indexed


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
