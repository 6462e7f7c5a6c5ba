"""Page (KV block) allocation for the paged KV cache. Pure Python: ids only, no tensors.

Every KV-cache group (target full-attention layers, target sliding-window layers, the drafter's
layers) indexes its own tensors with the same page ids, so one block table per request serves all
groups. Ref counts are kept per page so that shared (prefix) pages can be added without changing
the free-list logic.
"""

from __future__ import annotations

from collections import deque

from blockdraft.engine.request import Request


class KVCacheManager:
    """A pool of `num_blocks` pages of `kv_block_size` tokens with a free list and ref counts.

    Invariant: a page is in the free list iff its ref count is 0.
    """

    def __init__(self, num_blocks: int, kv_block_size: int) -> None:
        self.num_blocks = num_blocks
        self.kv_block_size = kv_block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of pages in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.kv_block_size)

    def allocate_slots(self, request: Request, num_tokens: int) -> bool:
        """Grow `request.block_ids` so that it holds `num_tokens` tokens in total.

        Returns False (allocating nothing) when the pool has too few free pages.
        """
        extra = self.blocks_needed(num_tokens) - len(request.block_ids)
        if extra <= 0:
            return True
        if extra > len(self._free):
            return False
        for _ in range(extra):
            page = self._free.popleft()
            self._ref_counts[page] = 1
            request.block_ids.append(page)
        return True

    def free(self, request: Request) -> None:
        """Release every page of `request` (pages shared by others stay allocated)."""
        for page in reversed(request.block_ids):
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free.append(page)
        request.block_ids = []
