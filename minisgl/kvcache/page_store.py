"""The hierarchical prefix cache's lower tiers: whole KV pages kept outside the pool, keyed by
the token prefix they end, read back when a later request's prefix continues past what the
pool still holds.

A page's key chains the keys before it: key(page i) = blake2b(key(page i - 1) + page i's ids),
seeded by the pool's fingerprint (the model and its weights' files, quantization, dtypes, the
pages' layout, page size and tensor-parallel size), so a page written for another model or
layout never matches. A page's payload is every rank's `KVPool.read_pages` row, rank by rank.

- `HostTier`: payloads in host memory (pinned on a GPU host), least recently used first out.
- `DiskTier` (`--hicache-storage-backend file`): one file per page, named by its key: a header
  (magic, the key, the payload's length and CRC-32) and the payload. The index is rebuilt
  from the folder at start (a warm start); a file whose header or CRC does not check is
  ignored with a warning and removed, never served; past the size limit the least recently
  used files go. The CRC catches a file cut short or corrupted (a forger who can write the
  folder could rewrite any unkeyed digest as well), at a fraction of a cryptographic hash's
  cost (BENCHMARKS.md, "Hierarchical cache").
- `PageStore`: the tiers in order, the thread that writes them and the one that reads them
  (never the event loop's). A save goes to every tier (each keeps its own least recently used
  pages); a load takes each page from the first tier that has it, into one buffer. Their
  copies run in numpy: no OpenMP team of torch's on these threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

KEY_BYTES = 16
MAGIC = b"MSGLKV01"
HEADER = struct.Struct(f"<8s{KEY_BYTES}sQI")  # magic, key, payload length, payload CRC-32
SUFFIX = ".kvpage"
TIERS = ("host", "disk")  # the tiers' names, from the top
STALE_PARTIAL_S = 600.0  # a file still being written this long after its last write is a crash's


def page_keys(fingerprint: bytes, token_ids: list[int], page_size: int, start: int = 0
              ) -> list[bytes]:
    """The keys of the whole pages of token_ids from page `start` on (the ones before it are
    hashed too: each key chains on its predecessors)."""
    keys, key = [], fingerprint
    for index, at in enumerate(range(0, len(token_ids) - page_size + 1, page_size)):
        page = ",".join(map(str, token_ids[at:at + page_size])).encode()
        key = hashlib.blake2b(key + page, digest_size=KEY_BYTES).digest()
        if index >= start:
            keys.append(key)
    return keys


@dataclass(frozen=True)
class TierStats:
    """A tier's pages and their bytes now, and the pages a read refused since start."""

    pages: int
    nbytes: int
    rejected: int = 0


class HostTier:
    name = "host"

    def __init__(self, max_bytes: int, pin: bool = False) -> None:
        self.max_bytes, self.pin = max_bytes, pin
        self._pages: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recent first
        self._nbytes = 0
        self._lock = threading.Lock()

    @property
    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(len(self._pages), self._nbytes)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pages

    def put(self, key: bytes, payload: torch.Tensor) -> None:
        if payload.numel() > self.max_bytes:
            return
        copy = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=self.pin)
        np.copyto(copy.numpy(), payload.numpy())  # NOTE: numpy: no OpenMP team on this thread
        with self._lock:
            if key in self._pages:
                self._pages.move_to_end(key)
                return
            self._pages[key] = copy
            self._nbytes += copy.numel()
            while self._nbytes > self.max_bytes:
                _, old = self._pages.popitem(last=False)
                self._nbytes -= old.numel()

    def read_into(self, key: bytes, out: np.ndarray) -> bool:
        with self._lock:
            payload = self._pages.get(key)
            if payload is None:
                return False
            self._pages.move_to_end(key)
        np.copyto(out, payload.numpy())
        return True


class DiskTier:
    name = "disk"

    def __init__(self, folder: Path, payload_bytes: int, max_bytes: int) -> None:
        self.folder = folder
        self.payload_bytes = payload_bytes
        self.file_bytes = HEADER.size + payload_bytes
        self.max_bytes = max_bytes
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._rejected = 0
        self._scan()

    def _scan(self) -> None:
        for partial in self.folder.glob("*.partial"):  # NOTE: a crashed writer's, if old
            with contextlib.suppress(OSError):
                if time.time() - partial.stat().st_mtime > STALE_PARTIAL_S:
                    partial.unlink()
        found = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                key = bytes.fromhex(path.stem)
                stat = path.stat()
            except (ValueError, OSError):
                key, stat = b"", None
            if stat is None or len(key) != KEY_BYTES or stat.st_size != self.file_bytes:
                logger.warning("hierarchical cache: %s is not a page of this pool (its name or "
                               "size); ignored", path)
                continue
            found.append((stat.st_mtime_ns, key))
        for _, key in sorted(found):
            self._index[key] = None
        self._trim()
        logger.info("hierarchical cache: %d pages on disk in %s", len(self._index), self.folder)

    def _path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}{SUFFIX}"

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def put(self, key: bytes, payload: torch.Tensor) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
        data = memoryview(payload.contiguous().numpy()).cast("B")
        assert len(data) == self.payload_bytes
        digest = zlib.crc32(data)
        path = self._path(key)
        partial = path.with_suffix(f".{os.getpid()}.partial")  # NOTE: a folder may be shared
        try:
            self.folder.mkdir(parents=True, exist_ok=True)  # NOTE: in case it was removed
            with open(partial, "wb") as f:
                f.write(HEADER.pack(MAGIC, key, len(data), digest))
                f.write(data)
            os.replace(partial, path)
        except OSError as exc:
            logger.warning("hierarchical cache: could not write %s (%s)", path, exc)
            partial.unlink(missing_ok=True)
            return
        with self._lock:
            self._index[key] = None
        self._trim()

    def read_into(self, key: bytes, out: np.ndarray) -> bool:
        """Read the page of `key` into `out` (its payload's bytes); False, the file removed
        with a warning, where it does not check."""
        path = self._path(key)
        header = bytearray(HEADER.size)
        try:
            with open(path, "rb") as f:
                sizes = (f.readinto(header), f.readinto(memoryview(out)), len(f.read(1)))
        except OSError:
            self._forget(key)
            return False
        if sizes == (HEADER.size, self.payload_bytes, 0):
            magic, stored_key, length, digest = HEADER.unpack(header)
            if (magic == MAGIC and stored_key == key and length == self.payload_bytes
                    and zlib.crc32(out) == digest):
                with self._lock:
                    if key in self._index:
                        self._index.move_to_end(key)
                return True
        logger.warning("hierarchical cache: %s does not check (cut short, altered or another "
                       "format); ignored and removed", path)
        with self._lock:
            self._rejected += 1
        self._forget(key)
        path.unlink(missing_ok=True)
        return False

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._index.pop(key, None)

    def _trim(self) -> None:
        while True:
            with self._lock:
                if len(self._index) * self.file_bytes <= self.max_bytes:
                    return
                key, _ = self._index.popitem(last=False)
            self._path(key).unlink(missing_ok=True)

    @property
    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(len(self._index), len(self._index) * self.file_bytes, self._rejected)


Tier = HostTier | DiskTier


@dataclass
class Loaded:
    """A load's result: `payloads` [pages, payload_bytes] (host; pinned for a GPU) holds the
    first pages asked for, each from the first tier that had it intact (`tiers`: its name)."""

    payloads: torch.Tensor
    tiers: list[str] = field(default_factory=list)
    seconds: float = 0.0


MAX_PENDING_SAVE_BYTES = 2**30  # saves queued past this are dropped (the disk is behind)


class PageStore:
    """Saves and loads each run on a thread of their own, in order: a read never waits for the
    writes queued before it."""

    def __init__(self, tiers: list[Tier], payload_bytes: int, pin: bool = False) -> None:
        if not tiers:
            raise ValueError("a page store needs a tier")
        self.tiers, self.payload_bytes, self.pin = tiers, payload_bytes, pin
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minisgl-hicache-w")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minisgl-hicache-r")
        self._writing: set[bytes] = set()  # saved, not yet in every tier
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self.saved_bytes = 0
        self.dropped_bytes = 0  # saves dropped: the queue was past MAX_PENDING_SAVE_BYTES

    def has(self, key: bytes) -> bool:
        with self._lock:
            if key in self._writing:
                return True
        return any(key in tier for tier in self.tiers)

    def hits(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, some tier holds (its index only: no IO)."""
        count = 0
        while count < len(keys) and any(keys[count] in tier for tier in self.tiers):
            count += 1
        return count

    def save(self, keys: list[bytes], payloads: torch.Tensor,
             ready: Callable[[], None] | None = None) -> Future | None:
        """Write [len(keys), payload_bytes] (the caller's copy, host memory) in the background;
        `ready` (a copy's completion, e.g. a CUDA event's synchronize) runs first there. None:
        dropped, the queue being full."""
        with self._lock:
            if self._pending_bytes + payloads.numel() > MAX_PENDING_SAVE_BYTES:
                self.dropped_bytes += payloads.numel()
                return None
            self._pending_bytes += payloads.numel()
            self._writing.update(keys)
        return self._writer.submit(self._save, keys, payloads, ready)

    def _save(self, keys: list[bytes], payloads: torch.Tensor,
              ready: Callable[[], None] | None) -> None:
        try:
            if ready is not None:
                ready()
            for key, payload in zip(keys, payloads):
                for tier in self.tiers:
                    tier.put(key, payload)
            self.saved_bytes += payloads.numel()
        except Exception:  # NOTE: nobody awaits a save; its pages are simply not kept
            logger.exception("hierarchical cache: a save failed")
        finally:
            with self._lock:
                self._writing.difference_update(keys)
                self._pending_bytes -= payloads.numel()

    def load(self, keys: list[bytes], done: Callable[[Loaded], None]) -> Future:
        """Read `keys` in the background, up to the first page no tier has or serves intact;
        `done(result)` runs on the reading thread."""
        return self._reader.submit(self._load, keys, done)

    def _load(self, keys: list[bytes], done: Callable[[Loaded], None]) -> None:
        start = time.perf_counter()
        buffer = torch.empty((len(keys), self.payload_bytes), dtype=torch.uint8,
                             pin_memory=self.pin)
        rows, tiers = buffer.numpy(), []
        try:
            for i, key in enumerate(keys):
                name = next((tier.name for tier in self.tiers
                             if key in tier and tier.read_into(key, rows[i])), None)
                if name is None:
                    break
                if name != self.tiers[0].name:  # NOTE: a disk hit warms the host tier
                    self.tiers[0].put(key, buffer[i])
                tiers.append(name)
        except Exception:  # an unreadable tier serves nothing more: the rest is recomputed
            logger.exception("hierarchical cache: a load failed")
        finally:
            done(Loaded(buffer[:len(tiers)], tiers, time.perf_counter() - start))

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
