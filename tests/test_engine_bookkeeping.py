"""The engine's bookkeeping without a model: KV blocks (BlockManager) and who runs next
(Scheduler). A "step" here is what the engine does around a forward: schedule a batch, then
append one sampled token to each of its sequences."""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest
import torch

from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.runner import ModelRunner
from flare.serve.engine.scheduler import ScheduledBatch, Scheduler
from flare.serve.engine.sequence import SamplingParams, Sequence, Status

BLOCK = 4


def seq(tokens: list[int] | range) -> Sequence:
    return Sequence(list(tokens), SamplingParams(), max_tokens=64)


def step(scheduler: Scheduler, token: int = 999) -> ScheduledBatch:
    """One engine step: the scheduled batch, each of its sequences one token longer."""
    batch = scheduler.schedule()
    assert batch is not None, "nothing was scheduled"
    for s in batch.seqs:
        s.append(token)
    return batch


def ids(seqs: Iterable[Sequence]) -> list[int]:
    return [s.id for s in seqs]


# -- BlockManager ----------------------------------------------------------------------------


def test_a_sequence_gets_one_block_per_block_size_tokens_each_its_own() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BLOCK)
    a = seq(range(10))
    blocks.allocate(a)
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3
    assert all(blocks.blocks[b].ref_count == 1 for b in a.block_table)
    assert len(blocks.free) == 5


def test_appending_takes_a_new_block_only_when_the_last_one_is_full() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BLOCK)
    a = seq(range(8))
    blocks.allocate(a)
    tables = []
    for token in range(100, 105):
        a.append(token)
        blocks.append_slot(a)
        tables.append(len(a.block_table))
    assert tables == [3, 3, 3, 3, 4]  # tokens 9..12 fill block 3; token 13 starts block 4


def test_equal_prefixes_share_their_full_blocks_counted_by_reference() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BLOCK)
    a, b = seq([*range(8), 50, 51]), seq([*range(8), 60])
    blocks.allocate(a)
    blocks.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [blocks.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert b.num_cached_tokens == 8 and blocks.stats()["prefix_hit_tokens"] == 8
    assert len(blocks.free) == 8 - 4


def test_the_last_token_is_always_computed_even_when_its_block_is_cached() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BLOCK)
    a, b = seq(range(8)), seq(range(8))
    blocks.allocate(a)
    blocks.allocate(b)  # the step needs the last token's logits: block 2 is computed again
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_a_freed_sequence_leaves_its_full_blocks_cached_for_an_equal_prefix() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BLOCK)
    a = seq(range(9))
    blocks.allocate(a)
    first_two = a.block_table[:2]
    blocks.free_sequence(a)
    assert a.block_table == [] and len(blocks.free) == 8
    b = seq([*range(8), 70])
    blocks.allocate(b)
    assert b.block_table[:2] == first_two and b.num_cached_tokens == 8


def test_free_blocks_are_handed_out_again_tail_first_evicting_their_cached_content() -> None:
    blocks = BlockManager(num_blocks=4, block_size=BLOCK)
    a = seq(range(13))  # three full blocks and a partial one: all four
    blocks.allocate(a)
    blocks.free_sequence(a)
    assert blocks.stats()["blocks_cached"] == 3
    blocks.allocate(seq([90]))  # the partial tail block: nothing cached is lost
    assert blocks.stats()["evictions"] == 0
    other = seq([91])
    blocks.allocate(other)  # a's third full block, no longer cached
    assert blocks.stats()["evictions"] == 1 and blocks.stats()["blocks_cached"] == 2
    blocks.free_sequence(other)
    again = seq([*range(8), 77])
    blocks.allocate(again)  # a's first two blocks are still cached
    assert again.num_cached_tokens == 8


def test_allocation_counts_only_the_blocks_a_sequence_does_not_share() -> None:
    blocks = BlockManager(num_blocks=4, block_size=BLOCK)
    blocks.allocate(seq(range(9)))  # three blocks, one left free
    unshared = seq(range(100, 109))
    assert not blocks.try_allocate(unshared)  # shares none, needs three: nothing changes
    assert unshared.block_table == [] and len(blocks.free) == 1
    with pytest.raises(RuntimeError, match="no room in the KV cache"):
        blocks.allocate(unshared)
    assert blocks.try_allocate(seq([*range(8), 80]))  # shares two, needs one
    assert len(blocks.free) == 0


def test_a_pending_token_names_its_full_block_only_once_its_value_is_known() -> None:
    """A block that a pending token fills is named when the token resolves, from its value,
    so a later prompt with those tokens finds it; never from the placeholder."""
    m = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(1, 4))
    m.allocate(a)
    a.append_pending()
    m.append_slot(a)
    assert m.stats()["blocks_cached"] == 0
    a.resolve(4)
    m.name_newest(a)
    assert m.stats()["blocks_cached"] == 1
    b = seq([1, 2, 3, 4, 5])
    m.allocate(b)
    assert b.block_table[0] == a.block_table[0] and b.num_cached_tokens == 4


def test_blocks_named_as_decode_fills_them_are_found_by_a_prompt_of_those_tokens() -> None:
    """Names made a block at a time while decoding are the names a prompt's blocks get all
    at once: a later prompt of the prompt and generated tokens reuses every full block, and
    its block table's page array is its id list after growing past its first array."""
    m = BlockManager(num_blocks=64, block_size=BLOCK)
    a = seq(range(1, 7))
    m.allocate(a)
    for token in range(100, 140):  # 40 tokens: ten more blocks named one by one
        a.append(token)
        m.append_slot(a)
    b = seq([*a.token_ids, 7])
    m.allocate(b)
    assert b.num_cached_tokens == len(a.token_ids) // BLOCK * BLOCK == 44
    assert b.block_table[:11] == a.block_table[:11] and len(b.block_table) == 12
    assert b.kv_table.pages(12).tolist() == b.block_table


def test_a_failed_step_unnames_its_blocks_so_no_later_request_reuses_them() -> None:
    blocks = BlockManager(num_blocks=8, block_size=BLOCK)
    a = seq(range(9))
    blocks.allocate(a)
    blocks.forget(a)
    blocks.free_sequence(a)
    b = seq(range(9))
    blocks.allocate(b)
    assert b.num_cached_tokens == 0 and blocks.stats()["blocks_cached"] == 2  # b's own


# -- Scheduler -------------------------------------------------------------------------------


def scheduler(num_blocks: int = 16, max_num_seqs: int = 8, max_tokens: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK), max_num_seqs, max_tokens)


def test_waiting_requests_are_admitted_in_arrival_order_as_one_prefill() -> None:
    s = scheduler()
    a, b, c = seq(range(5)), seq(range(10, 13)), seq(range(20, 26))
    for x in (a, b, c):
        s.add(x)
    batch = step(s)
    assert batch.prefill and ids(batch.seqs) == ids([a, b, c])
    assert ids(s.running) == ids([a, b, c]) and not s.waiting
    assert all(x.status is Status.RUNNING for x in (a, b, c))


def test_admission_stops_at_the_token_budget_and_at_max_num_seqs() -> None:
    s = scheduler(max_num_seqs=2, max_tokens=10)
    a, b, c, d = seq(range(6)), seq(range(6)), seq(range(3)), seq(range(3))
    for x in (a, b, c, d):
        s.add(x)
    assert ids(step(s).seqs) == ids([a])  # b's 6 tokens would pass the budget of 10
    assert ids(step(s).seqs) == ids([b])
    assert not step(s).prefill  # two running: c and d wait, a and b decode
    assert ids(s.waiting) == ids([c, d])


def test_a_batch_invariant_scheduler_prefills_each_prompt_in_a_step_of_its_own() -> None:
    """A prefill's products round by the tokens they hold: prompts prefilled together could
    differ from each alone. Decodes still batch every running sequence."""
    s = Scheduler(BlockManager(16, BLOCK), 8, 64, prefill_alone=True)
    a, b, c = seq(range(5)), seq(range(10, 13)), seq(range(20, 26))
    for x in (a, b, c):
        s.add(x)
    assert [ids(step(s).seqs) for _ in range(3)] == [ids([a]), ids([b]), ids([c])]
    decode = step(s)
    assert not decode.prefill and ids(decode.seqs) == ids([a, b, c])


def test_a_manager_that_reuses_no_prefix_gives_a_repeated_prompt_fresh_blocks() -> None:
    """Batch-invariant serving computes every prompt whole, as it would alone."""
    blocks = BlockManager(16, BLOCK, reuse_prefixes=False)
    first, again = seq(range(3 * BLOCK)), seq(range(3 * BLOCK))
    blocks.allocate(first)
    blocks.free_sequence(first)
    blocks.allocate(again)
    assert again.num_cached_tokens == 0 and blocks.prefix_hit_tokens == 0


def test_a_cached_prefix_does_not_count_against_the_token_budget() -> None:
    s = scheduler(max_tokens=10)
    s.add(seq([*range(8), 1]))
    step(s)
    b, c = seq([*range(8), 2]), seq([50, 51])
    s.add(b)
    s.add(c)
    assert ids(step(s).seqs) == ids([b, c])  # b computes 1 token, c 2: 3 of 10


def test_a_prompt_longer_than_the_token_budget_is_admitted_alone() -> None:
    s = scheduler(max_tokens=10)
    long, short = seq(range(30)), seq(range(3))
    s.add(long)
    s.add(short)
    assert ids(step(s).seqs) == ids([long])
    assert ids(step(s).seqs) == ids([short])


def test_new_requests_prefill_before_the_running_ones_decode_together() -> None:
    s = scheduler()
    a, b = seq(range(5)), seq(range(10, 15))
    s.add(a)
    step(s)
    s.add(b)
    batch = step(s)
    assert batch.prefill and ids(batch.seqs) == ids([b]) and len(a) == 6  # a waited
    batch = step(s)
    assert not batch.prefill and ids(batch.seqs) == ids([a, b])


def test_finishing_a_running_sequence_frees_its_blocks_and_takes_it_out() -> None:
    s = scheduler(num_blocks=4)
    a = seq(range(9))
    s.add(a)
    step(s)
    s.finish(a)
    assert a.status is Status.FINISHED and not s.running and a.block_table == []
    assert len(s.blocks.free) == 4
    s.finish(a)  # the engine may retire a request twice (cancelled as it finished)
    assert all(block.ref_count == 0 for block in s.blocks.blocks)


def test_cancelling_a_waiting_sequence_takes_it_out_and_frees_nothing_else() -> None:
    s = scheduler(num_blocks=4, max_num_seqs=1)
    a, b = seq([*range(8), 1]), seq([*range(8), 2])
    s.add(a)
    s.add(b)
    step(s)
    s.finish(b)  # waiting, holds no blocks; shares a's prefix, which a still holds
    assert ids(s.waiting) == [] and ids(s.running) == ids([a])
    assert [s.blocks.blocks[i].ref_count for i in a.block_table] == [1, 1, 1]


def test_decode_out_of_blocks_preempts_the_newest_running_sequence_to_wait_first() -> None:
    s = scheduler(num_blocks=6, max_num_seqs=3)
    a, b, c = seq(range(8)), seq(range(20, 28)), seq(range(30, 38))  # every block taken
    d = seq(range(40, 42))  # waits: three run at most
    for x in (a, b, c, d):
        s.add(x)
    step(s)  # a, b and c grow to 9 tokens: each needs a third block to decode
    batch = step(s)
    assert ids(batch.seqs) == ids([a, b]) and s.preemptions == 1  # c's two blocks for a, b
    assert ids(s.waiting) == ids([c, d]) and c.status is Status.WAITING and c.block_table == []
    assert len(a.block_table) == len(b.block_table) == 3


def test_a_preempted_sequence_comes_back_as_a_prefill_from_its_surviving_blocks() -> None:
    s = scheduler(num_blocks=4)
    a, b = seq(range(8)), seq(range(20, 28))
    s.add(a)
    s.add(b)
    step(s)
    step(s)  # b preempted; a took b's freed tail block, evicting what it held
    s.finish(a)
    batch = step(s)
    assert batch.prefill and ids(batch.seqs) == ids([b])
    assert b.num_cached_tokens == 4  # its first block was still cached; the rest recomputed


# -- a prefill step's input ------------------------------------------------------------------


def test_a_prefills_kv_slots_are_each_positions_slot_from_any_cached_start() -> None:
    """The slots a prefill writes, taken a block's run at a time, are position p's block's
    slot p % block size for every position after the cached prefix, whether that prefix ends
    inside a block, on its edge, or is empty."""
    runner = ModelRunner(None, None, BLOCK, torch.device("cpu"))  # type: ignore[arg-type]
    blocks = BlockManager(num_blocks=100, block_size=BLOCK)
    chooser = random.Random(5)
    for length in (1, 3, 4, 5, 17, 40):
        blocks.allocate(seq(chooser.sample(range(1000), chooser.randrange(1, 30))))
        s = seq(chooser.sample(range(1000), length))  # blocks not in order, nor from 0
        blocks.allocate(s)
        for cached in sorted({0, length - 1, length // 2, (length - 1) // BLOCK * BLOCK}):
            s.num_cached_tokens = cached
            slots = runner.step_input([s], prefill=True).slots
            want = [s.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, length)]
            assert slots == want, (length, cached)
