"""Fixed-size KV blocks: the unit of allocation, cropping and (in the hybrid cache) routing."""

from __future__ import annotations

import torch

from engine.errors import OutOfMemoryError


class BlockAllocator:
    """A free list over `n_blocks` block ids; allocation never touches tensor memory."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfMemoryError(
                f"the KV cache is full ({self.n_blocks} blocks in use)",
                "end or shorten a chat, lower max_batch, or raise max_context",
            )
        return self._free.pop()

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class SequenceBlocks:
    """One sequence's block table: token p lives in blocks[p // block_size] at p % block_size."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.blocks: list[int] = []
        self.length = 0

    def ensure(self, n_tokens: int, allocator: BlockAllocator) -> None:
        while len(self.blocks) * self.block_size < n_tokens:
            self.blocks.append(allocator.allocate())

    def crop(self, n_tokens: int, allocator: BlockAllocator) -> None:
        keep = -(-n_tokens // self.block_size)  # ceil
        allocator.release(self.blocks[keep:])
        del self.blocks[keep:]
        self.length = min(self.length, n_tokens)

    def slots(self, start: int, stop: int) -> torch.Tensor:
        """Flat slot index (block · block_size + offset) of positions start..stop-1, int64 (stop-start,)."""
        bs = self.block_size
        first, last = start // bs, -(-stop // bs)
        table = torch.tensor(self.blocks[first:last], dtype=torch.int64)  # (n_blocks,)
        flat = (table[:, None] * bs + torch.arange(bs)).flatten()  # (n_blocks · bs,)
        return flat[start - first * bs : stop - first * bs]
