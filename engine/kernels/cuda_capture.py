"""What a failed CUDA graph capture leaves behind, put back.

torch registers its default CUDA generator with every capture when it begins, and takes it back
only when the capture ends cleanly. A capture that fails (an op that syncs with the host, an
allocator assertion) leaves the generator in capture mode, and every later random draw on that
device fails with "Offset increment outside graph capture" (seen on the H200 with torch 2.11).
Each place that captures saves the generator's state first and restores it on failure.
"""

from __future__ import annotations

import torch


class GeneratorState:
    """The default CUDA generator of `device`, as it was before a capture."""

    def __init__(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.generator = torch.cuda.default_generators[index]
        self.state = self.generator.clone_state()  # a fresh state object, not in capture mode

    def restore(self) -> None:
        self.generator.graphsafe_set_state(self.state)
