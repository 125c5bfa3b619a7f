"""KV-cache block accounting: which fixed-size blocks each sequence owns."""
from __future__ import annotations

from collections import deque

import numpy as np

from duetserve.engine.sequence import Sequence


class BlockManager:
    """Hands out KV-cache blocks of ``block_size`` tokens from a pool of ``num_blocks``.

    A sequence holding ``n`` tokens of KV owns ``ceil(n / block_size)`` blocks, in
    ``seq.block_table`` order; token ``i`` lives in slot
    ``block_table[i // block_size] * block_size + i % block_size``. ``seq.block_array``
    mirrors ``block_table`` as int32 (``allocate`` writes both; after ``free`` its valid part
    is empty).
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks in use, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_tokens`` tokens of KV."""
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        """Whether ``seq`` can grow to ``num_tokens`` tokens and leave ``reserve`` blocks free (a
        negative ``reserve``: with that many more blocks free, e.g. those of sequences about to end)."""
        return self.blocks_needed(seq, num_tokens) + reserve <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens.

        Raises:
            RuntimeError: not enough free blocks (call ``can_allocate`` first).
        """
        need = self.blocks_needed(seq, num_tokens)
        if not need:
            return
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, free {len(self._free)}")
        old = len(seq.block_table)
        seq.block_table.extend(self._free.popleft() for _ in range(need))
        n = old + need  # the int32 mirror (Sequence.block_array), grown by doubling
        if len(seq.block_array) < n:
            grown = np.zeros(max(n, 2 * len(seq.block_array)), dtype=np.int32)
            grown[:old] = seq.block_array[:old]
            seq.block_array = grown
        seq.block_array[old:n] = seq.block_table[old:n]

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the pool."""
        self._free.extend(seq.block_table)
        seq.block_table.clear()
