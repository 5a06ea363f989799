"""Tests for the prefix caches (radix tree and the no-op cache), at page sizes 1 and 4."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.kvcache.prefix_cache import NaiveCache, RadixCache
from minisgl.kvcache.state_cache import StateRadixCache

PAGE_SIZES = [1, 4]


class Pool:
    """Hands out fresh pages of locations, never reusing one (so every location is unique)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.next_page = 0

    def alloc(self, num_tokens: int) -> torch.Tensor:
        assert num_tokens % self.page_size == 0
        start = self.next_page * self.page_size
        self.next_page += num_tokens // self.page_size
        return torch.arange(start, start + num_tokens, dtype=torch.int64)


def seq(page_size: int, *pages: int) -> list[int]:
    """A token sequence of whole pages; page value v becomes tokens [v*100, v*100+1, ...]."""
    return [v * 100 + i for v in pages for i in range(page_size)]


def check(cache: RadixCache, evictable: int | None = None, protected: int | None = None) -> None:
    locs = cache.all_locations()
    assert len(locs) == len(set(locs.tolist())), "duplicate location in cache"
    assert cache.size == cache.evictable_size + cache.protected_size == len(locs)
    assert cache.evictable_size >= 0 and cache.protected_size >= 0
    if evictable is not None:
        assert cache.evictable_size == evictable
    if protected is not None:
        assert cache.protected_size == protected


def as_set(t: torch.Tensor) -> set[int]:
    return set(t.tolist())


@pytest.fixture(params=PAGE_SIZES, ids=lambda p: f"page{p}")
def page_size(request: pytest.FixtureRequest) -> int:
    return request.param


def test_empty_cache(page_size: int) -> None:
    cache = RadixCache(page_size)
    handle, locs = cache.match_prefix(seq(page_size, 1, 2))
    assert handle.length == 0 and len(locs) == 0 and locs.dtype == torch.int64
    cache.lock(handle)
    cache.unlock(handle)
    assert len(cache.evict(100)) == 0
    check(cache, 0, 0)
    assert len(cache.reset()) == 0


def test_insert_then_match(page_size: int) -> None:
    p, pool, cache = page_size, Pool(page_size), RadixCache(page_size)
    tokens = seq(p, 1, 2, 3)
    locs = pool.alloc(len(tokens))
    assert len(cache.insert(tokens, locs)) == 0
    check(cache, 3 * p, 0)

    handle, got = cache.match_prefix(tokens)
    assert handle.length == 3 * p and torch.equal(got, locs)
    # longer query: only the cached part matches
    handle, got = cache.match_prefix(tokens + seq(p, 9))
    assert handle.length == 3 * p and torch.equal(got, locs)
    # a prefix
    handle, got = cache.match_prefix(seq(p, 1, 2))
    assert handle.length == 2 * p and torch.equal(got, locs[: 2 * p])
    # diverging after one page
    handle, got = cache.match_prefix(seq(p, 1, 7, 3))
    assert handle.length == p and torch.equal(got, locs[:p])
    # diverging at the first token
    handle, got = cache.match_prefix(seq(p, 5))
    assert handle.length == 0 and len(got) == 0
    check(cache, 3 * p, 0)  # matches that split nodes do not change the accounting


def test_insert_copies_locations(page_size: int) -> None:
    p, cache = page_size, RadixCache(page_size)
    locs = Pool(p).alloc(2 * p)
    expected = locs.clone()
    cache.insert(seq(p, 1, 2), locs)
    locs.fill_(-1)  # the caller reuses its buffer (e.g. a page-table row)
    _, got = cache.match_prefix(seq(p, 1, 2))
    assert torch.equal(got, expected)


def test_partial_pages_are_not_matched() -> None:
    p, cache = 4, RadixCache(4)
    tokens = seq(p, 1, 2)
    locs = Pool(p).alloc(2 * p)
    cache.insert(tokens, locs)
    for n in range(len(tokens) + 1):
        handle, got = cache.match_prefix(tokens[:n])
        assert handle.length == n - n % p and torch.equal(got, locs[: handle.length])
    # divergence in the middle of the second page matches only the first page
    handle, _ = cache.match_prefix(tokens[:p] + [tokens[p], -1, tokens[p + 2], tokens[p + 3]])
    assert handle.length == p


def test_insert_rejects_unaligned() -> None:
    cache = RadixCache(4)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], torch.arange(3))
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], torch.arange(3))


def test_split_at_page_boundary(page_size: int) -> None:
    p, pool, cache = page_size, Pool(page_size), RadixCache(page_size)
    a, b = seq(p, 1, 2, 3, 4), seq(p, 1, 2, 8, 9)
    la, lb = pool.alloc(4 * p), pool.alloc(4 * p)
    cache.insert(a, la)
    rejected = cache.insert(b, lb)
    assert torch.equal(rejected, lb[: 2 * p])  # the shared 2 pages were already cached
    check(cache, 6 * p, 0)
    assert as_set(cache.all_locations()) == as_set(la) | as_set(lb[2 * p:])
    _, got = cache.match_prefix(a)
    assert torch.equal(got, la)
    _, got = cache.match_prefix(b)
    assert torch.equal(got, torch.cat([la[: 2 * p], lb[2 * p:]]))
    # a third branch off the middle of an edge
    c, lc = seq(p, 1, 2, 3, 7), pool.alloc(4 * p)
    assert torch.equal(cache.insert(c, lc), lc[: 3 * p])
    _, got = cache.match_prefix(c)
    assert torch.equal(got, torch.cat([la[: 3 * p], lc[3 * p:]]))
    check(cache, 7 * p, 0)


def test_insert_returns_only_differing_locations(page_size: int) -> None:
    p, pool, cache = page_size, Pool(page_size), RadixCache(page_size)
    base = seq(p, 1, 2)
    lbase = pool.alloc(2 * p)
    cache.insert(base, lbase)
    # the usual flow: match, compute the rest, insert with the matched locations in front
    handle, matched = cache.match_prefix(base + seq(p, 3))
    cache.lock(handle)
    new = pool.alloc(p)
    rejected = cache.insert(base + seq(p, 3), torch.cat([matched, new]))
    assert len(rejected) == 0
    cache.unlock(handle)
    check(cache, 3 * p, 0)
    # inserting exactly what is cached takes nothing and returns nothing
    _, everything = cache.match_prefix(base + seq(p, 3))
    assert len(cache.insert(base + seq(p, 3), everything)) == 0
    # a mix: first page identical, second page different -> only the second page comes back
    other = pool.alloc(p)
    rejected = cache.insert(base, torch.cat([lbase[:p], other]))
    assert torch.equal(rejected, other)
    check(cache, 3 * p, 0)
    # an empty insert is a no-op
    assert len(cache.insert([], torch.empty(0, dtype=torch.int64))) == 0


def test_lock_protects_from_evict(page_size: int) -> None:
    p, pool, cache = page_size, Pool(page_size), RadixCache(page_size)
    a, b = seq(p, 1, 2, 3), seq(p, 1, 5)
    la, lb = pool.alloc(3 * p), pool.alloc(2 * p)
    cache.insert(a, la)
    cache.insert(b, lb)
    check(cache, 4 * p, 0)

    handle, _ = cache.match_prefix(seq(p, 1, 2))  # splits the [2, 3] edge
    cache.lock(handle)
    check(cache, 2 * p, 2 * p)
    cache.lock(handle)  # locks nest
    check(cache, 2 * p, 2 * p)

    freed = cache.evict(100 * p)
    assert as_set(freed) == as_set(la[2 * p:]) | as_set(lb[p:])
    check(cache, 0, 2 * p)
    _, got = cache.match_prefix(a)
    assert torch.equal(got, la[: 2 * p])

    cache.unlock(handle)
    check(cache, 0, 2 * p)
    cache.unlock(handle)
    check(cache, 2 * p, 0)
    with pytest.raises(RuntimeError):
        cache.unlock(handle)
    assert as_set(cache.evict(1)) == as_set(la[p: 2 * p])  # a whole leaf goes: page 2 ...
    assert as_set(cache.evict(1)) == as_set(la[:p])  # ... then page 1, split off by b's insert
    check(cache, 0, 0)


def test_lock_survives_later_split(page_size: int) -> None:
    p, pool, cache = page_size, Pool(page_size), RadixCache(page_size)
    a = seq(p, 1, 2, 3)
    cache.insert(a, pool.alloc(3 * p))
    handle, _ = cache.match_prefix(a)
    cache.lock(handle)
    check(cache, 0, 3 * p)
    cache.insert(seq(p, 1, 4), pool.alloc(2 * p))  # splits the locked edge after one page
    check(cache, p, 3 * p)
    cache.unlock(handle)
    check(cache, 4 * p, 0)


def test_evict_lru_order(page_size: int) -> None:
    p, pool, cache = page_size, Pool(page_size), RadixCache(page_size)
    seqs = [seq(p, 1, 10), seq(p, 2, 20), seq(p, 3, 30)]
    locs = [pool.alloc(2 * p) for _ in seqs]
    for s, l in zip(seqs, locs):
        cache.insert(s, l)
    cache.match_prefix(seqs[0])  # 0 is now the most recent; order: 1, 2, 0
    assert as_set(cache.evict(1)) == as_set(locs[1])
    check(cache, 4 * p, 0)
    assert as_set(cache.evict(2 * p + 1)) == as_set(locs[2]) | as_set(locs[0])
    check(cache, 0, 0)


def test_evict_leaves_before_parents(page_size: int) -> None:
    p, pool, cache = page_size, Pool(page_size), RadixCache(page_size)
    parent, l_parent = seq(p, 1, 2), pool.alloc(2 * p)
    cache.insert(parent, l_parent)
    child, l_child = seq(p, 1, 2, 3), pool.alloc(3 * p)
    cache.insert(child, l_child)  # l_child[:2p] rejected; the leaf holds l_child[2p:]
    other, l_other = seq(p, 9), pool.alloc(p)
    cache.insert(other, l_other)
    cache.match_prefix(parent)  # touches only the parent
    # LRU leaf is the child (touched at its insert, before `other`), then `other`,
    # then the parent, which only becomes a leaf once its child is gone.
    assert as_set(cache.evict(p)) == as_set(l_child[2 * p:])
    assert as_set(cache.evict(p)) == as_set(l_other)
    assert as_set(cache.evict(p)) == as_set(l_parent)
    check(cache, 0, 0)


def test_evict_cascades_up_a_chain(page_size: int) -> None:
    p, pool, cache = page_size, Pool(page_size), RadixCache(page_size)
    l1 = pool.alloc(p)
    cache.insert(seq(p, 1), l1)
    cache.insert(seq(p, 1, 2), torch.cat([l1, l2 := pool.alloc(p)]))
    cache.insert(seq(p, 1, 2, 3), torch.cat([l1, l2, l3 := pool.alloc(p)]))
    freed = cache.evict(3 * p)
    assert as_set(freed) == as_set(l1) | as_set(l2) | as_set(l3)
    check(cache, 0, 0)


def test_stale_handle_is_detected(page_size: int) -> None:
    p, cache = page_size, RadixCache(page_size)
    cache.insert(seq(p, 1), Pool(p).alloc(p))
    handle, _ = cache.match_prefix(seq(p, 1))
    cache.evict(p)
    with pytest.raises(RuntimeError):
        cache.lock(handle)


def test_reset(page_size: int) -> None:
    p, pool, cache = page_size, Pool(page_size), RadixCache(page_size)
    la, lb = pool.alloc(2 * p), pool.alloc(2 * p)
    cache.insert(seq(p, 1, 2), la)
    cache.insert(seq(p, 3, 4), lb)
    handle, _ = cache.match_prefix(seq(p, 1))
    cache.lock(handle)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(handle)
    assert as_set(cache.reset()) == as_set(la) | as_set(lb)
    check(cache, 0, 0)
    handle, got = cache.match_prefix(seq(p, 1, 2))
    assert handle.length == 0 and len(got) == 0
    cache.insert(seq(p, 1, 2), la)  # usable again
    check(cache, 2 * p, 0)


def test_naive_cache(page_size: int) -> None:
    p, cache = page_size, NaiveCache(page_size)
    locs = Pool(p).alloc(2 * p)
    assert torch.equal(cache.insert(seq(p, 1, 2), locs), locs)
    handle, got = cache.match_prefix(seq(p, 1, 2))
    assert handle.length == 0 and len(got) == 0
    cache.lock(handle)
    cache.unlock(handle)
    assert len(cache.evict(10)) == 0 and len(cache.all_locations()) == 0 and len(cache.reset()) == 0
    assert cache.size == cache.evictable_size == cache.protected_size == 0
    with pytest.raises(ValueError):
        cache.insert(seq(p, 1), torch.arange(p + 1))


@pytest.mark.parametrize("seed", range(8))
def test_fuzz(page_size: int, seed: int) -> None:
    """Simulate a scheduler over a finite pool: match+lock, allocate (evicting when short),
    insert and unlock, with interleaved requests. Every location is always in exactly one of:
    the free list, the cache, or a running request; and every cached page holds the KV that was
    computed for exactly the prefix it is matched under."""
    p, rng = page_size, random.Random(seed)
    num_pages = 64
    free: set[int] = set(range(num_pages * p))
    cache = RadixCache(p)
    owner: dict[int, tuple[int, ...]] = {}  # first location of a page -> the prefix it was computed for
    running: list[tuple[list[int], object, torch.Tensor, torch.Tensor]] = []
    stems = [[rng.randrange(6) for _ in range(rng.randrange(0, 4) * p)] for _ in range(4)]

    def alloc(n: int) -> torch.Tensor | None:
        if len(free) < n:
            freed = cache.evict(n - len(free))
            assert not (as_set(freed) & free)
            free.update(freed.tolist())
        if len(free) < n:
            return None
        pages = sorted({loc - loc % p for loc in free})
        assert all(all(pg + i in free for i in range(p)) for pg in pages), "free list not page-aligned"
        chosen = rng.sample(pages, n // p)
        out = torch.tensor([pg + i for pg in chosen for i in range(p)], dtype=torch.int64)
        free.difference_update(out.tolist())
        return out

    def check_match(tokens: list[int], locs: torch.Tensor) -> None:
        assert len(locs) % p == 0 and len(locs) <= len(tokens)
        for i in range(0, len(locs), p):
            page = locs[i:i + p].tolist()
            assert page == list(range(page[0], page[0] + p)) and page[0] % p == 0
            assert owner[page[0]] == tuple(tokens[: i + p]), "cache returned KV of another prefix"

    def check_all() -> None:
        check(cache)
        held = as_set(cache.all_locations())
        in_requests: set[int] = set()
        for _, _, _, new in running:
            in_requests |= as_set(new)
        assert not (held & free) and not (held & in_requests) and not (free & in_requests)
        assert held | free | in_requests == set(range(num_pages * p)), "location leaked"
        # matches end exactly at a node, so the locked tokens are exactly the running matches
        assert cache.protected_size == len({loc for _, _, m, _ in running for loc in m.tolist()})

    for _ in range(300):
        op = rng.random()
        if op < 0.45:  # start a request
            tokens = rng.choice(stems) + [rng.randrange(6) for _ in range(rng.randrange(0, 5) * p)]
            if not tokens:
                continue
            handle, matched = cache.match_prefix(tokens + [7] * rng.randrange(p))  # + partial page
            check_match(tokens, matched)
            cache.lock(handle)
            new = alloc(len(tokens) - handle.length)
            if new is None:
                cache.unlock(handle)
                continue
            for i in range(0, len(new), p):
                owner[int(new[i])] = tuple(tokens[: handle.length + i + p])
            running.append((tokens, handle, matched, new))
        elif op < 0.8 and running:  # finish a request
            tokens, handle, matched, new = running.pop(rng.randrange(len(running)))
            rejected = cache.insert(tokens, torch.cat([matched, new]))
            assert as_set(rejected) <= as_set(new), "cache returned a location it owns"
            assert len(rejected) == len(as_set(rejected))
            free.update(rejected.tolist())
            cache.unlock(handle)
        elif op < 0.9:  # insert a sequence computed from scratch (duplicates likely)
            tokens = rng.choice(stems) + [rng.randrange(6) for _ in range(rng.randrange(1, 4) * p)]
            new = alloc(len(tokens))
            if new is None:
                continue
            for i in range(0, len(new), p):
                owner[int(new[i])] = tuple(tokens[: i + p])
            rejected = cache.insert(tokens, new)
            assert as_set(rejected) <= as_set(new) and len(rejected) == len(as_set(rejected))
            free.update(rejected.tolist())
        else:  # memory pressure
            before = cache.evictable_size
            freed = cache.evict(rng.randrange(1, 4 * p))
            assert len(freed) <= before and (len(freed) > 0 or before == 0)
            free.update(freed.tolist())
        check_all()
        for _, handle, matched, _ in running:  # locked prefixes are still cached, same locations
            assert as_set(matched) <= as_set(cache.all_locations())

    for tokens, handle, matched, new in running:
        free.update(cache.insert(tokens, torch.cat([matched, new])).tolist())
        cache.unlock(handle)
    running.clear()
    check(cache, evictable=cache.size, protected=0)
    free.update(cache.evict(cache.size).tolist())
    check(cache, 0, 0)
    assert free == set(range(num_pages * p))


@pytest.mark.parametrize("page_size", [4])  # NOTE: a partial last page needs page_size > 1
def test_share_hands_a_running_requests_pages_to_the_cache(page_size: int) -> None:
    """CacheManager.share: the prefilled whole pages of a live request become matchable (and
    stay locked by it); its release then frees only what the cache does not hold."""
    from minisgl.scheduler.memory import CacheManager
    cache = RadixCache(page_size)
    manager = CacheManager(16, page_size, cache)
    tokens = seq(page_size, 1, 2, 3) + [7]
    handle, _ = manager.match(tokens)
    manager.lock(handle)
    pages = manager.allocate(4)
    kv = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:len(tokens)]
    handle = manager.share(tokens, kv[:2 * page_size], 0, handle)
    shared_len = handle.length
    assert shared_len == 2 * page_size
    check(cache, evictable=0, protected=2 * page_size)
    found, locs = manager.match(seq(page_size, 1, 2, 9))
    assert found.length == 2 * page_size and locs.tolist() == kv[:2 * page_size].tolist()
    assert manager.share(tokens, kv[:2 * page_size + 1], shared_len, handle) is None  # no new page
    handle = manager.share(tokens, kv, shared_len, handle)
    shared_len = handle.length
    assert shared_len == 3 * page_size
    check(cache, evictable=0, protected=3 * page_size)
    manager.release(tokens, kv, shared_len, handle)
    check(cache, evictable=3 * page_size, protected=0)
    assert manager.num_free == 16 - 3  # the partial last page went back


def test_share_skips_what_another_request_cached_meanwhile(page_size: int) -> None:
    from minisgl.scheduler.memory import CacheManager
    cache = RadixCache(page_size)
    manager = CacheManager(16, page_size, cache)
    tokens = seq(page_size, 1, 2)
    handle, _ = manager.match(tokens)
    manager.lock(handle)
    mine = (manager.allocate(2)[:, None] * page_size + torch.arange(page_size)).flatten()
    theirs = (manager.allocate(2)[:, None] * page_size + torch.arange(page_size)).flatten()
    cache.insert(tokens, theirs)
    assert manager.share(tokens, mine, 0, handle) is None
    assert NaiveCache(page_size).holds_prefixes is False
    naive = CacheManager(16, page_size, NaiveCache(page_size))
    assert naive.share(tokens, mine, 0, naive.match(tokens)[0]) is None


# ---- a hybrid model's cache: prefixes resume only where a state snapshot was kept ----------


def test_a_hybrid_match_stops_at_the_deepest_node_with_a_snapshot() -> None:
    cache, pool = StateRadixCache(4, first_slot=10, num_slots=2), Pool(4)
    tokens = seq(4, 1, 2, 3, 4)
    cache.insert(tokens, pool.alloc(16))
    assert cache.match_prefix(tokens)[0].length == 0  # no snapshot: nothing resumes
    slot = cache.take_slot()
    assert slot == 10 and cache.attach_at(tokens[:8], slot)
    handle, locations = cache.match_prefix(tokens)
    assert handle.length == len(locations) == 8 and cache.snapshot_of(handle) == 10
    assert cache.match_prefix(tokens[:4])[0].length == 0  # the state at 4 is not kept
    other = cache.take_slot()
    assert not cache.attach_at(tokens[:8], other)  # one snapshot per node: the caller's still
    cache.give_slot(other)


def test_hybrid_snapshots_go_least_recently_used_first_but_never_a_locked_one() -> None:
    cache, pool = StateRadixCache(1, first_slot=0, num_slots=2), Pool(1)
    prompts = [[1, 2, 3], [4, 5, 6]]
    for prompt in prompts:
        cache.insert(prompt, pool.alloc(3))
        assert cache.attach_at(prompt, cache.take_slot())
    held, _ = cache.match_prefix(prompts[0])
    cache.lock(held)
    assert cache.match_prefix(prompts[1])[0].length == 3  # now the most recent, but unlocked
    assert cache.take_slot() is not None  # drops [4, 5, 6]'s snapshot: its node stays
    assert cache.match_prefix(prompts[1])[0].length == 0
    assert len(cache.all_locations()) == 6
    assert cache.take_slot() is None  # the other one is locked
    cache.unlock(held)
    assert cache.take_slot() is not None and cache.free_slots == []


def test_evicting_or_resetting_a_hybrid_cache_frees_its_snapshots() -> None:
    cache, pool = StateRadixCache(2, first_slot=5, num_slots=3), Pool(2)
    for page in (1, 2):
        tokens = seq(2, page, 7)
        cache.insert(tokens, pool.alloc(4))
        assert cache.attach_at(tokens, cache.take_slot())
    assert sorted(cache.held_slots) == [5, 6]
    assert len(cache.evict(4)) == 4  # one whole branch: its snapshot with it
    assert len(cache.held_slots) == 1 and len(cache.free_slots) == 2
    cache.reset()
    assert sorted(cache.free_slots) == [5, 6, 7] and cache.held_slots == []
