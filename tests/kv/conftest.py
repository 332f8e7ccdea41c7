import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The simulated hybrid runs two threads at once: this one stands in for the GPU and the worker
    computes the CPU side. One torch thread each keeps their OpenMP pools from oversubscribing a
    small CI machine (as on a real machine, where the GPU-driving thread keeps a core of its own)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
