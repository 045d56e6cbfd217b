"""ChunkSet: the supervisor's per-chunk state at one byte a chunk, behaving as a set of ints."""

from __future__ import annotations

import random
import tracemalloc

from chunkq.supervisor.store.chunk_set import ChunkSet


def test_a_chunk_set_behaves_as_a_set_of_indices() -> None:
    rng = random.Random(7)
    flags, model = ChunkSet(50, full=True), set(range(50))
    for _ in range(2000):
        index = rng.randrange(-3, 25_000)
        if rng.random() < 0.5 and index >= 0:
            flags.add(index)
            model.add(index)
        else:
            flags.discard(index)
            model.discard(index)
        assert (index in flags) == (index in model)
        if rng.random() < 0.05:
            n = rng.randrange(0, 30)
            lowest = sorted(model)[:n]
            assert flags.take_lowest(n) == lowest
            model -= set(lowest)
        assert len(flags) == len(model)
    assert list(flags) == sorted(model)
    assert [i for block in flags.blocks(7) for i in block] == sorted(model)
    assert "3" not in flags and None not in flags


def test_taking_the_lowest_after_adding_below_the_last_taken() -> None:
    flags = ChunkSet()
    flags.update([5, 9, 12])
    assert flags.take_lowest(2) == [5, 9]
    flags.add(1)  # a requeued chunk comes back below the cursor
    assert flags.take_lowest(5) == [1, 12]
    assert flags.take_lowest(1) == [] and len(flags) == 0


def test_a_million_pending_chunks_cost_about_a_megabyte() -> None:
    tracemalloc.start()
    try:
        flags = ChunkSet(1_000_000, full=True)
        for index in range(0, 1_000_000, 3):
            flags.discard(index)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 1.5 * 2**20  # a set of these ints takes ~50 MB
    assert len(flags) == 666_666
