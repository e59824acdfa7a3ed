"""BlockManager: exact block ids for allocation, free order, prefix hits, LRU eviction, ref counts."""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.block_manager import BlockManager, hash_block
from runtime.config import Row


@dataclass
class Owner:
    """The fields of a Sequence the block manager touches (runtime.block_manager.BlockOwner)."""

    rows: list[Row]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0


def rows(*texts: int) -> list[Row]:
    return [(t, 512) for t in texts]


def compute(bm: BlockManager, seq: Owner, num_tokens: int) -> list[int] | None:
    """Allocate for `num_tokens` new rows, mark them computed, publish full blocks."""
    new = bm.allocate_slots(seq, num_tokens)
    if new is not None:
        seq.num_computed_tokens += num_tokens
        bm.cache_full_blocks(seq)
    return new


def test_allocation_order_growth_and_no_room() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    a, b = Owner(rows(*range(10))), Owner(rows(*range(100, 105)))
    assert compute(bm, a, 10) == [0, 1, 2]
    assert compute(bm, b, 5) == [3, 4]
    a.rows.append((7, 7))
    assert compute(bm, a, 1) == []  # row 11 still fits block 2
    a.rows.append((8, 8))
    assert compute(bm, a, 1) == []  # row 12 fills block 2
    assert bm.num_blocks_needed(a, 1) == 1
    assert compute(bm, a, 1) == [5]
    assert a.block_table == [0, 1, 2, 5]
    assert bm.num_free_blocks == 0 and bm.num_used_blocks == 6
    # No room: None, and nothing changed.
    b.num_computed_tokens = 8
    assert bm.can_allocate(b, 1) is False
    assert bm.allocate_slots(b, 1) is None
    assert b.block_table == [3, 4]
    assert [bm.ref_count(i) for i in range(6)] == [1] * 6


def test_free_returns_blocks_tail_first_and_reuses_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = Owner(rows(*range(13))), Owner(rows(*range(3)))
    assert compute(bm, a, 13) == [0, 1, 2, 3]
    assert compute(bm, b, 3) == [4]
    bm.free(a)
    assert a.block_table == []
    assert bm.free_block_order() == [0, 1, 2, 3, 5, 6, 7]
    assert [bm.ref_count(i) for i in range(8)] == [0, 0, 0, 0, 1, 0, 0, 0]
    c = Owner(rows(*range(50, 56)))
    assert compute(bm, c, 6) == [0, 1]


def test_prefix_hits_are_chained_and_leave_last_row() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Owner(rows(*range(10)))
    assert compute(bm, a, 10) == [0, 1, 2]  # blocks 0 and 1 full -> cached
    assert a.num_published_blocks == 2
    assert a.block_hashes == [hash_block(None, a.rows[:4]), hash_block(a.block_hashes[0], a.rows[4:8])]

    same_prefix = Owner(rows(*range(8), 99, 98, 97))
    assert bm.find_cached_prefix(same_prefix) == [0, 1]
    exactly_two_blocks = Owner(rows(*range(8)))
    assert bm.find_cached_prefix(exactly_two_blocks) == [0]  # the last row is always computed
    first_block_differs = Owner(rows(42, 1, 2, 3, 4, 5, 6, 7, 8))
    assert bm.find_cached_prefix(first_block_differs) == []  # block 2 equal, parent differs
    audio_differs = Owner([(0, 1), *rows(1, 2, 3, 4, 5, 6, 7, 8)])
    assert bm.find_cached_prefix(audio_differs) == []  # both channels are hashed

    # Take the hit: ref counts bumped, only the tail is new.
    assert bm.allocate_slots(same_prefix, 3, cached_block_ids=[0, 1]) == [3]
    same_prefix.num_computed_tokens = 11
    assert same_prefix.block_table == [0, 1, 3]
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    bm.free(a)
    assert [bm.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    bm.free(same_prefix)
    assert bm.num_used_blocks == 0


def test_lru_eviction_of_cached_blocks() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = Owner(rows(1, 2, 3, 4, 5))  # blocks 0, 1 full and cached, block 2 partial
    b = Owner(rows(7, 8, 9))  # block 3 full and cached, block 4 partial
    assert compute(bm, a, 5) == [0, 1, 2]
    assert compute(bm, b, 3) == [3, 4]
    bm.free(a)  # tail first: 2 (uncached) to the front, then 1, 0 to the back
    bm.free(b)  # 4 (uncached) to the front, then 3 to the back
    assert bm.free_block_order() == [4, 2, 5, 1, 0, 3]
    assert bm.num_used_blocks == 0
    # Cached content survives freeing.
    assert bm.find_cached_prefix(Owner(rows(1, 2, 3, 4, 0))) == [0, 1]
    # Taking 4 fresh blocks uses the uncached ones, then evicts the least recently freed (1).
    c = Owner(rows(*range(20, 28)))
    assert compute(bm, c, 8) == [4, 2, 5, 1]
    assert bm.find_cached_prefix(Owner(rows(1, 2, 3, 4, 0))) == [0]
    assert bm.find_cached_prefix(Owner(rows(7, 8, 0))) == [3]
    # A hit on a free cached block revives it (it leaves the free queue) and counts as room.
    d = Owner(rows(7, 8, 0))
    assert bm.can_allocate(d, 1, cached_block_ids=[3]) is True
    assert bm.allocate_slots(d, 1, cached_block_ids=[3]) == [0]  # 3 revived, 0 evicted
    assert d.block_table == [3, 0]
    assert bm.free_block_order() == []
    assert bm.find_cached_prefix(Owner(rows(1, 2, 3, 4, 0))) == []


def test_revived_blocks_count_against_room() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    a = Owner(rows(1, 2, 3))
    assert compute(bm, a, 3) == [0, 1]
    bm.free(a)
    b = Owner(rows(1, 2, 3, 4, 5, 6))  # hit on block 0, needs 2 more blocks: only 1 left
    assert bm.find_cached_prefix(b) == [0]
    assert bm.can_allocate(b, 4, cached_block_ids=[0]) is False
    assert bm.allocate_slots(b, 4, cached_block_ids=[0]) is None
    assert b.block_table == [] and bm.ref_count(0) == 0 and bm.free_block_order() == [1, 0]


def test_recomputed_blocks_are_published_after_preemption() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Owner(rows(1, 2, 3, 4, 5))
    assert compute(bm, a, 5) == [0, 1, 2]
    bm.free(a)  # preempted: hashes kept on the sequence
    a.num_computed_tokens = 0
    evictor = Owner(rows(9, 9, 9, 9, 9, 9))
    assert compute(bm, evictor, 6) == [2, 3, 1]  # evicts block 1 (second block of a)
    bm.free(evictor)
    assert bm.find_cached_prefix(a) == [0]
    assert bm.allocate_slots(a, 3, cached_block_ids=[0]) is not None
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    assert bm.find_cached_prefix(Owner(rows(1, 2, 3, 4, 0))) == a.block_table[:2]


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = Owner(rows(1, 2, 3))
    compute(bm, a, 3)
    assert a.block_hashes == []
    assert bm.find_cached_prefix(Owner(rows(1, 2, 3))) == []
