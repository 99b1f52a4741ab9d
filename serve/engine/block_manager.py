"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, prefix reuse.

A full block is named by a hash of its token ids chained with the previous block's hash, so
equal prefixes name equal blocks. A block whose last user left goes to the back of the free
queue but keeps its hash: a later request with the same prefix takes it back without
recomputing it, until it is evicted by being handed out for other tokens (oldest first).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from flare.serve.engine.sequence import BlockTable, Sequence


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: bytes | None = None


TOKEN = "I"
"""A token id in a block's name: an unsigned 32-bit int (array's "I" is 4 bytes on the
platforms torch runs on; checked below), in the host's byte order (names live in one
process)."""
assert array(TOKEN).itemsize == 4


def block_names(previous: bytes | None, token_ids: list[int], block_size: int) -> Iterator[bytes]:
    """The names of the full blocks of `token_ids`, in order, each a hash of its tokens and
    of the name before it (the first's: `previous`), so a name stands for its tokens and
    everything before them. The tokens become bytes once, not a block at a time: admitting
    a new 8K-token prompt took 1.2-1.3 ms instead of 1.6-1.7 (tests/bench/bench_admission.py;
    1.2 ms more before, with the bytes built a token at a time)."""
    data = memoryview(array(TOKEN, token_ids).tobytes())
    width = block_size * array(TOKEN).itemsize
    for start in range(0, len(data) - width + 1, width):
        h = hashlib.blake2b(previous or b"", digest_size=16)
        h.update(data[start : start + width])
        previous = h.digest()
        yield previous


class Blocks:
    """Every block by id, each made on its first use: a GPU's cache holds a few hundred
    thousand blocks, whose objects made all at once took 0.16 s of a start for 220,000
    blocks on a CPU here (0.36 s in a profiled start on the H200), and few of them are
    handed out before the cache fills."""

    def __init__(self, count: int) -> None:
        self._made: list[Block | None] = [None] * count

    def __getitem__(self, block_id: int) -> Block:
        block = self._made[block_id]
        if block is None:
            block = self._made[block_id] = Block(block_id)
        return block

    def __len__(self) -> int:
        return len(self._made)

    def __iter__(self) -> Iterator[Block]:
        return (self[block_id] for block_id in range(len(self._made)))


class BlockManager:
    """Hands out KV blocks to sequences; reuses cached full blocks of equal prefixes."""

    def __init__(self, num_blocks: int, block_size: int, reuse_prefixes: bool = True) -> None:
        self.block_size = block_size
        self.reuse_prefixes = reuse_prefixes
        """Off where the server keeps batches invariant: a prompt that found its prefix
        cached would compute only the rest, in products of other shapes than alone."""
        self.blocks = Blocks(num_blocks)
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.by_hash: dict[bytes, int] = {}
        self.prefix_hit_tokens = 0
        self.evictions = 0

    # -- admission ------------------------------------------------------------------------

    def try_allocate(self, seq: Sequence) -> bool:
        """Give the sequence its blocks if the free queue covers every one it does not
        share; False, nothing changed, if not. Its cached prefix is looked up once for both
        (an 8K-token prompt seen before names 511 blocks to find it)."""
        cached = self._cached_prefix(seq)
        shared = sum(1 for b in cached if self.blocks[b].ref_count > 0)
        if seq.num_blocks(self.block_size) - shared > len(self.free):
            return False
        self._allocate(seq, cached)
        return True

    def allocate(self, seq: Sequence) -> None:
        """Give the sequence its blocks, which the free queue must cover."""
        if not self.try_allocate(seq):
            raise RuntimeError(f"no room in the KV cache for sequence {seq.id}'s blocks")

    def _allocate(self, seq: Sequence, cached: list[int]) -> None:
        """Cached prefix blocks first, then fresh ones."""
        for block_id in cached:
            self._take(block_id)
        seq.kv_table = BlockTable(cached)
        seq.num_cached_tokens = len(cached) * self.block_size
        self.prefix_hit_tokens += seq.num_cached_tokens
        previous = self.blocks[cached[-1]].hash if cached else None
        fresh = [self._fresh() for _ in range(len(cached), seq.num_blocks(self.block_size))]
        seq.kv_table.extend([block.id for block in fresh])
        rest = seq.token_ids[seq.num_cached_tokens :]
        names = block_names(previous, rest, self.block_size)
        for block, name in zip(fresh, names, strict=False):  # a last block not full: unnamed
            self._name(block, name)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks, leaving at least its
        last token to compute (the step needs that token's logits)."""
        found: list[int] = []
        if not self.reuse_prefixes:
            return found
        leading = seq.token_ids[: (len(seq) - 1) // self.block_size * self.block_size]
        for name in block_names(None, leading, self.block_size):
            block_id = self.by_hash.get(name)
            if block_id is None:
                break
            found.append(block_id)
        return found

    # -- decoding -------------------------------------------------------------------------

    def can_append(self, seq: Sequence) -> bool:
        """Whether the sequence's newest token has a slot (a new block if it starts one)."""
        return not self._needs_block(seq) or len(self.free) > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the newest token's KV; name the last block once it is full (once the
        newest token's value is known: a pending one names it when it resolves)."""
        if self._needs_block(seq):
            seq.kv_table.append(self._fresh().id)
        if not seq.pending:
            self.name_newest(seq)

    def name_newest(self, seq: Sequence) -> None:
        """Name the block holding the newest token if it is full and handed out: at the
        newest token's slot, or when a pending token resolves after its slot was handed
        out (its KV written by a step launched before anything later reads it). A block is
        full only when the newest token takes its last slot: every other token returns at
        once (this runs for every token of every sequence)."""
        if len(seq.token_ids) % self.block_size:
            return
        index = (len(seq) - 1) // self.block_size
        if index >= len(seq.block_table):
            return
        previous = self.blocks[seq.block_table[index - 1]].hash if index > 0 else None
        if index > 0 and previous is None:  # a block before it is unnamed: so is this one
            return
        tokens = seq.block_tokens(index, self.block_size)
        name = next(block_names(previous, tokens, self.block_size))
        self._name(self.blocks[seq.block_table[index]], name)

    def _needs_block(self, seq: Sequence) -> bool:
        return len(seq.block_table) < seq.num_blocks(self.block_size)

    # -- release --------------------------------------------------------------------------

    def free_sequence(self, seq: Sequence) -> None:
        """Drop the sequence's references; its tail blocks become the first to evict."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.kv_table = BlockTable()
        seq.num_cached_tokens = 0

    def forget(self, seq: Sequence) -> None:
        """Unname the sequence's blocks: after a failed forward, the ones named for it in that
        step lack their KV (a block is named when its slots are handed out, before the write)."""
        for block_id in seq.block_table:
            self._unname(self.blocks[block_id])

    def forget_cached(self) -> None:
        """Unname every block: after an engine fault, any named block may lack its KV."""
        for block in self.blocks:
            block.hash = None
        self.by_hash.clear()

    # -- internals ------------------------------------------------------------------------

    def _take(self, block_id: int) -> None:
        self.free.pop(block_id, None)
        self.blocks[block_id].ref_count += 1

    def _fresh(self) -> Block:
        """The oldest free block, evicting its cached content."""
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            self._unname(block)
            self.evictions += 1
        block.ref_count = 1
        return block

    def _unname(self, block: Block) -> None:
        if block.hash is not None and self.by_hash.get(block.hash) == block.id:
            del self.by_hash[block.hash]
        block.hash = None

    def _name(self, block: Block, name: bytes) -> None:
        """Name a full block so later requests can find it (the first of a name keeps it).
        Called when the block's KV is written in the same step, so a named block is valid."""
        block.hash = name
        self.by_hash.setdefault(name, block.id)

    def stats(self) -> dict[str, int]:
        used = len(self.blocks) - len(self.free)
        return {
            "block_size": self.block_size,
            "blocks_total": len(self.blocks),
            "blocks_used": used,
            "blocks_cached": len(self.by_hash),
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "evictions": self.evictions,
        }
