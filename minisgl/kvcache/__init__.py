"""The paged KV pool and the prefix caches that share its pages between requests."""

from minisgl.kvcache.pool import KVLayout, KVPool
from minisgl.kvcache.prefix_cache import CacheHandle, NaiveCache, PrefixCache, RadixCache
from minisgl.kvcache.state_cache import StateRadixCache

__all__ = ["CacheHandle", "KVLayout", "KVPool", "NaiveCache", "PrefixCache", "RadixCache", "StateRadixCache"]
