from __future__ import annotations

import random

import pytest
import torch

from specserve.runtime.mem_cache import KVPool, OutOfSlotsError, ReqToTokenTable, TokenSlotAllocator


def test_allocator_free_count_returns_to_capacity_after_random_alloc_free():
    rng = random.Random(0)
    alloc = TokenSlotAllocator(1000)
    held: list[torch.Tensor] = []
    for _ in range(500):
        if held and rng.random() < 0.45:
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(0, 40)
            if n <= alloc.num_free:
                s = alloc.alloc(n)
                assert bool((s >= 1).all()), "slot 0 is padding"
                held.append(s)
            else:
                with pytest.raises(OutOfSlotsError):
                    alloc.alloc(n)
        alloc.check_integrity()
    all_held = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
    assert all_held.unique().numel() == all_held.numel(), "a slot was handed out twice"
    for s in held:
        alloc.free(s)
    alloc.check_integrity()
    assert alloc.num_free == alloc.capacity


def test_allocator_rejects_double_free():
    alloc = TokenSlotAllocator(10)
    s = alloc.alloc(3)
    alloc.free(s)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(s)


def test_req_table_rows_recycle_and_hold_slots():
    table = ReqToTokenTable(4, 16)
    rows = [table.alloc_row() for _ in range(4)]
    assert sorted(rows) == [0, 1, 2, 3] and table.num_free_rows == 0
    table.write(rows[1], 0, torch.tensor([5, 6, 7]))
    table.write(rows[1], 3, torch.tensor([9]))
    assert table.slots(rows[1], 4).tolist() == [5, 6, 7, 9]
    for r in rows:
        table.free_row(r)
    assert table.num_free_rows == 4
    with pytest.raises(AssertionError, match="exceeds"):
        table.write(0, 15, torch.tensor([1, 2]))


def test_kv_pool_move_copies_every_layer():
    pool = KVPool(8, 3, 2, 4, torch.float32, "cpu")
    for layer in range(3):
        pool.k[layer].normal_()
        pool.v[layer].normal_()
    src, dst = torch.tensor([5, 6]), torch.tensor([1, 2])
    expect = [pool.k[layer][src].clone() for layer in range(3)]
    pool.move(src, dst)
    for layer in range(3):
        torch.testing.assert_close(pool.k[layer][dst], expect[layer])


@pytest.mark.parametrize("src, dst", [
    ([5, 6], [1, 2]),  # disjoint
    ([2, 3], [1, 2]),  # a commit's shape: a source read before a later copy writes it
    ([2, 3], [3, 4]),  # in order, copy 1 would overwrite copy 2's source: gathered first
    ([4, 2], [2, 7]),
])
def test_kv_pool_move_equals_gather_then_scatter(src, dst):
    """`move` gives every destination the source's value from before the move, whichever way
    it copies (one copy per slot in order, or gather then scatter), in every layer, K and V,
    and leaves every other slot alone."""
    pool = KVPool(8, 3, 2, 4, torch.float32, "cpu")
    for layer in range(3):
        pool.k[layer].normal_()
        pool.v[layer].normal_()
    before_k = [t.clone() for t in pool.k]
    before_v = [t.clone() for t in pool.v]
    pool.move(torch.tensor(src), torch.tensor(dst))
    for layer in range(3):
        for now, before in ((pool.k[layer], before_k[layer]), (pool.v[layer], before_v[layer])):
            want = before.clone()
            want[torch.tensor(dst)] = before[torch.tensor(src)]
            assert torch.equal(now, want)
