"""KV block pool: allocation, reference counts and prefix caching of full blocks.

One block id addresses the same `block_size` slots in every layer instance of the KV cache
(see `kv_cache.py`), so a sequence needs one block table for all 40 layers.

Prefix caching (vLLM v1 style): a block is hashed only once it is full AND its rows have been
computed. Its hash chains the parent block's hash with the block's rows (both channels), so
equal rows under a different prefix get a different hash. A freed block whose ref count drops
to zero keeps its hash and stays findable until the pool needs it back; the free queue hands
out blocks that hold nothing reusable first, then hashed blocks in least-recently-freed order.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from runtime.config import Row


class BlockOwner(Protocol):
    """What the block manager reads and writes on a sequence (see `runtime.sequence.Sequence`)."""

    rows: list[Row]
    num_computed_tokens: int
    block_table: list[int]
    block_hashes: list[bytes]  # content hashes of the first full blocks; survive preemption
    num_published_blocks: int  # leading blocks of block_table already checked into the cache


def hash_block(parent_hash: bytes | None, rows: Sequence[Row]) -> bytes:
    """Content hash of one full block chained to its parent's hash (None for the first block)."""
    flat = array("q", [token for row in rows for token in row])
    digest = hashlib.sha256(parent_hash or b"\0")
    digest.update(flat.tobytes())
    return digest.digest()


@dataclass
class Block:
    """Book-keeping of one KV block; `block_hash` is set while its full content is cached."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockManager:
    """Owns the pool of KV block ids; the scheduler is its only caller."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, in the order they will be handed out (front first).
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    # ----- queries -----
    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references (cached-but-evictable blocks included)."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free_queue)

    def ref_count(self, block_id: int) -> int:
        """Current reference count of `block_id`."""
        return self.blocks[block_id].ref_count

    def free_block_order(self) -> list[int]:
        """Free block ids in the order they would be handed out (for tests and debugging)."""
        return list(self._free_queue)

    def find_cached_prefix(self, seq: BlockOwner) -> list[int]:
        """Block ids of the longest cached prefix of `seq.rows` made of full blocks.

        At least the last row is always left out, because its logits are needed to sample.
        Does not change any state; pass the result to `allocate_slots` to take the blocks.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(seq.rows) - 1) // self.block_size
        found: list[int] = []
        parent: bytes | None = None
        for i in range(max_blocks):
            if i < len(seq.block_hashes):
                block_hash = seq.block_hashes[i]
            else:
                block_hash = hash_block(parent, seq.rows[i * self.block_size : (i + 1) * self.block_size])
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
            parent = block_hash
        return found

    def num_blocks_needed(self, seq: BlockOwner, num_new_tokens: int, cached_block_ids: Sequence[int] = ()) -> int:
        """New blocks `allocate_slots` would take for `num_new_tokens` more rows."""
        num_tokens = seq.num_computed_tokens + len(cached_block_ids) * self.block_size + num_new_tokens
        num_blocks = -(-num_tokens // self.block_size)
        return max(0, num_blocks - len(seq.block_table) - len(cached_block_ids))

    def can_allocate(self, seq: BlockOwner, num_new_tokens: int, cached_block_ids: Sequence[int] = ()) -> bool:
        """Whether `allocate_slots` with the same arguments would succeed."""
        num_revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        needed = self.num_blocks_needed(seq, num_new_tokens, cached_block_ids)
        return needed <= len(self._free_queue) - num_revived

    # ----- mutations -----
    def allocate_slots(
        self, seq: BlockOwner, num_new_tokens: int, cached_block_ids: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow `seq.block_table` to hold `num_new_tokens` more rows; None when there is no room.

        `cached_block_ids` (from `find_cached_prefix`, only for a sequence that holds no blocks)
        are referenced first and count as computed rows ahead of the new ones. Returns the ids of
        the freshly taken blocks; on None nothing has changed.
        """
        assert not cached_block_ids or not seq.block_table, "cached prefix only on an empty block table"
        if not self.can_allocate(seq, num_new_tokens, cached_block_ids):
            return None
        num_needed = self.num_blocks_needed(seq, num_new_tokens, cached_block_ids)
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            assert block.block_hash is not None
            if block.ref_count == 0:
                del self._free_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            if len(seq.block_hashes) < len(seq.block_table):
                seq.block_hashes.append(block.block_hash)
        seq.num_published_blocks += len(cached_block_ids)
        new_ids = [self._take_free_block() for _ in range(num_needed)]
        seq.block_table.extend(new_ids)
        return new_ids

    def free(self, seq: BlockOwner) -> None:
        """Drop `seq`'s references; blocks reaching zero go back to the free queue.

        Blocks are released tail first, so a prefix outlives its suffixes in the LRU order.
        Blocks holding no cached content go to the front (reused first).
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block_id] = None
                if block.block_hash is None:
                    self._free_queue.move_to_end(block_id, last=False)
        seq.block_table.clear()
        seq.num_published_blocks = 0

    def cache_full_blocks(self, seq: BlockOwner) -> None:
        """Hash and publish every block of `seq` that is full and fully computed."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_published_blocks, num_full):
            if i == len(seq.block_hashes):
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                rows = seq.rows[i * self.block_size : (i + 1) * self.block_size]
                seq.block_hashes.append(hash_block(parent, rows))
            block_hash = seq.block_hashes[i]
            block = self.blocks[seq.block_table[i]]
            # The same content may already be cached under another block (computed twice in
            # one step); keep the first, this block then simply stays uncached.
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id
        seq.num_published_blocks = max(seq.num_published_blocks, num_full)

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's prefix lookup (token counts)."""
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def _take_free_block(self) -> int:
        block_id, _ = self._free_queue.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.block_hash is not None:  # evict its cached content
            del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id
