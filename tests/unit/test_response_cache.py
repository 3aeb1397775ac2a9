"""Response cache: LRU order, stable slots, capacity 0, bit vectors."""

from __future__ import annotations

from raytrain_x.engine import ResponseCache


def _fill(cache: ResponseCache, names):
    return [cache.put(n, "float32", [len(n)], "allreduce.sum") for n in names]


def test_put_get_and_entry_fields():
    c = ResponseCache(4)
    slot = c.put("w", "float16", [3, 2], "allreduce.average")
    assert c.get("w") == {
        "name": "w",
        "dtype": "float16",
        "shape": (3, 2),
        "op": "allreduce.average",
        "slot": slot,
    }
    assert c.get("missing") is None
    assert "w" in c and len(c) == 1


def test_lru_eviction_reuses_the_evicted_slot():
    c = ResponseCache(3)
    slots = _fill(c, ["a", "b", "c"])
    assert slots == [0, 1, 2]
    c.get("a")  # a becomes most recently used; b is now the oldest
    assert c.lru_order() == ["b", "c", "a"]
    new_slot = c.put("d", "float32", [1], "allreduce.sum")
    assert "b" not in c
    assert new_slot == slots[1]
    assert c.lru_order() == ["c", "a", "d"]


def test_refresh_keeps_slot_and_updates_entry():
    c = ResponseCache(2)
    _fill(c, ["a", "b"])
    assert c.put("a", "float64", [9], "allgather") == 0
    assert c.get("a")["dtype"] == "float64"
    assert c.lru_order() == ["b", "a"]


def test_capacity_zero_disables():
    c = ResponseCache(0)
    assert c.put("a", "float32", [1], "allreduce.sum") == -1
    assert c.get("a") is None
    assert len(c) == 0
    assert c.bits(["a"]) == []


def test_erase_and_clear_free_slots():
    c = ResponseCache(2)
    _fill(c, ["a", "b"])
    assert c.erase("a") and not c.erase("a")
    assert c.put("z", "float32", [1], "x") == 0
    c.clear()
    assert len(c) == 0 and c.lru_order() == []
    assert c.put("q", "float32", [1], "x") == 0


def test_bits_and_entries_in_slot_order_across_words():
    c = ResponseCache(130)
    names = [f"t{i}" for i in range(130)]
    _fill(c, names)
    wanted = ["t129", "t3", "t64", "t0", "not-cached"]
    bits = c.bits(wanted)
    assert len(bits) == c.words == 3
    assert bits[0] == (1 << 0) | (1 << 3)
    assert bits[1] == 1 << 0
    assert bits[2] == 1 << 1
    assert [e["name"] for e in c.entries_for_bits(bits)] == ["t0", "t3", "t64", "t129"]


def test_bit_and_of_two_ranks_gives_common_names():
    rank0, rank1 = ResponseCache(8), ResponseCache(8)
    for cache in (rank0, rank1):
        _fill(cache, ["a", "b", "c", "d"])
    mine = rank0.bits(["a", "b", "d"])
    theirs = rank1.bits(["b", "c", "d"])
    common = [x & y for x, y in zip(mine, theirs)]
    assert [e["name"] for e in rank0.entries_for_bits(common)] == ["b", "d"]


def test_peek_does_not_touch_lru_order():
    c = ResponseCache(2)
    _fill(c, ["a", "b"])
    assert c.peek("a")["name"] == "a"
    assert c.lru_order() == ["a", "b"]
    assert c.peek("zz") is None


def test_bits_give_names_and_lru_touches_in_slot_order():
    # a cycle of cache hits reads the agreed names and touches them in one call each: the
    # same names and the same LRU order as a get of each entry of the bits in turn
    touched, got = ResponseCache(8), ResponseCache(8)
    _fill(touched, list("abcdef"))
    _fill(got, list("abcdef"))
    bits = touched.bits(["e", "b", "d"])
    assert touched.names_for_bits(bits) == ["b", "d", "e"]
    assert [e["name"] for e in touched.entries_for_bits(bits)] == ["b", "d", "e"]
    touched.touch_bits(bits)
    for entry in got.entries_for_bits(bits):
        got.get(entry["name"])
    assert touched.lru_order() == got.lru_order() == ["a", "c", "f", "b", "d", "e"]
