"""A single-producer, single-consumer queue of integer arrays in shared memory.

Rank 0 puts each step's forward input (a list of small int arrays) here, one queue per worker
rank; no pickling, no sockets on the hot path.

Layout: a `SharedMemory` segment with a 64-byte control block (word 0: bytes the reader has
consumed) followed by a ring of `capacity` bytes. A message is encoded once into a flat byte
payload ([n, (dtype, length) * n] as int64, then each array padded to 8 bytes) and written as
one or more fragments, each framed by [payload bytes, flags]; a message larger than a quarter
of the ring goes in several fragments, so any size fits. A frame that would cross the end of
the ring is preceded by a WRAP frame and starts again at offset 0.

Wake-ups: the writer sends one empty message down a pipe per fragment; the reader blocks in
`poll` on that pipe (no spinning), and the pipe doubles as a liveness signal: a reader whose
writer died sees EOF, a writer whose reader died gets BrokenPipeError. The writer waits for
room (only when the ring is full, which at 32 MiB a step never fills) by sleeping 1 ms between
looks at the reader's counter.
"""

from __future__ import annotations

import multiprocessing
import secrets
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Callable, Sequence

import numpy as np

CONTROL_BYTES = 64
FRAME_BYTES = 16
FLAG_LAST, FLAG_WRAP = 1, 2
DTYPES = [np.dtype(np.int64), np.dtype(np.int32)]
DTYPE_CODES = {dt: code for code, dt in enumerate(DTYPES)}
SHM_PREFIX = "minisgl-tp-"


class QueueClosed(RuntimeError):
    """The other end of the queue is gone."""


@dataclass(frozen=True)
class ReaderHandle:
    """What a worker process needs to attach (picklable once, at spawn)."""

    name: str
    capacity: int
    wake: Connection


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _pad16(n: int) -> int:
    return (n + 15) & ~15


def encode_arrays(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """[n, (dtype, length) * n] + each array's bytes padded to 8: one uint8 payload."""
    header = np.empty(1 + 2 * len(arrays), dtype=np.int64)
    header[0] = len(arrays)
    sizes = []
    for i, a in enumerate(arrays):
        header[1 + 2 * i] = DTYPE_CODES[a.dtype]
        header[2 + 2 * i] = a.size
        sizes.append(_pad8(a.nbytes))
    payload = np.zeros(header.nbytes + sum(sizes), dtype=np.uint8)
    payload[: header.nbytes] = header.view(np.uint8)
    offset = header.nbytes
    for a, size in zip(arrays, sizes):
        payload[offset: offset + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        offset += size
    return payload


def decode_arrays(payload: np.ndarray) -> list[np.ndarray]:
    """Inverse of `encode_arrays`; the arrays are views of `payload`."""
    count = int(payload[:8].view(np.int64)[0])
    header = payload[: 8 * (1 + 2 * count)].view(np.int64)
    offset = header.nbytes
    arrays = []
    for i in range(count):
        dtype, length = DTYPES[int(header[1 + 2 * i])], int(header[2 + 2 * i])
        nbytes = length * dtype.itemsize
        arrays.append(payload[offset: offset + nbytes].view(dtype))
        offset += _pad8(nbytes)
    return arrays


class ShmQueue:
    def __init__(self, shm: SharedMemory, capacity: int, wake: Connection, owner: bool) -> None:
        self.shm, self.capacity, self.wake, self.owner = shm, capacity, wake, owner
        self._control = np.ndarray((CONTROL_BYTES // 8,), np.int64, shm.buf)
        self._ring = np.ndarray((capacity,), np.uint8, shm.buf, offset=CONTROL_BYTES)
        self._max_fragment = capacity // 4 - FRAME_BYTES
        self._position = 0  # bytes written (writer) or read (reader), ever
        self._reader_wake: Connection | None = None
        self._closed = False

    # ---- set-up ------------------------------------------------------------------------------

    @classmethod
    def create(cls, capacity: int = 32 << 20) -> ShmQueue:
        """The writer's end; `reader_handle()` is passed to the worker process."""
        capacity = _pad16(max(capacity, 4096))
        name = SHM_PREFIX + secrets.token_hex(8)  # unique per queue; no fixed names
        shm = SharedMemory(name=name, create=True, size=CONTROL_BYTES + capacity)
        reader, writer = multiprocessing.Pipe(duplex=False)
        queue = cls(shm, capacity, writer, owner=True)
        queue._control[:] = 0
        queue._reader_wake = reader
        return queue

    def reader_handle(self) -> ReaderHandle:
        assert self._reader_wake is not None
        return ReaderHandle(self.shm.name, self.capacity, self._reader_wake)

    def forget_reader(self) -> None:
        """Close the writer process's copy of the reader's pipe end (after the spawn), so the
        writer sees BrokenPipeError once the reader is gone."""
        if self._reader_wake is not None:
            self._reader_wake.close()
            self._reader_wake = None

    @classmethod
    def attach(cls, handle: ReaderHandle) -> ShmQueue:
        shm = SharedMemory(name=handle.name, create=False)
        return cls(shm, handle.capacity, handle.wake, owner=False)

    def close(self) -> None:
        """Close this end; the creator also removes the segment from /dev/shm."""
        if self._closed:
            return
        self._closed = True
        self.forget_reader()
        self.wake.close()
        del self._control, self._ring  # numpy views pin the mapping
        self.shm.close()
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass

    # ---- writer ------------------------------------------------------------------------------

    def put(self, arrays: Sequence[np.ndarray], alive: Callable[[], bool] = lambda: True
            ) -> None:
        """Queue one message. Raises QueueClosed when the reader is gone (or `alive()` says
        so while waiting for room)."""
        payload = encode_arrays(arrays)
        total = len(payload)
        start = 0
        while True:
            end = min(start + self._max_fragment, total)
            self._put_fragment(payload[start:end], FLAG_LAST if end == total else 0, alive)
            if end == total:
                return
            start = end

    def _put_fragment(self, data: np.ndarray, flags: int, alive: Callable[[], bool]) -> None:
        need = FRAME_BYTES + _pad16(len(data))  # NOTE: 16-aligned, so a WRAP frame fits
        pos = self._position % self.capacity
        wrap = self.capacity - pos if self.capacity - pos < need else 0
        self._wait_room(wrap + need, alive)
        if wrap:
            self._frame(pos, 0, FLAG_WRAP)
            self._position += wrap
            pos = 0
        self._frame(pos, len(data), flags)
        self._ring[pos + FRAME_BYTES: pos + FRAME_BYTES + len(data)] = data
        self._position += need
        try:
            self.wake.send_bytes(b"")  # NOTE: the pipe write orders the ring writes before it
        except OSError as exc:
            raise QueueClosed("the reader of the queue is gone") from exc

    def _frame(self, pos: int, length: int, flags: int) -> None:
        self._ring[pos: pos + FRAME_BYTES].view(np.int64)[:] = (length, flags)

    def _wait_room(self, need: int, alive: Callable[[], bool]) -> None:
        while self.capacity - (self._position - int(self._control[0])) < need:
            if not alive():
                raise QueueClosed("the reader of the queue is gone")
            time.sleep(0.001)

    # ---- reader ------------------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> list[np.ndarray] | None:
        """The next message (arrays owned by the caller), or None after `timeout` seconds.
        Raises QueueClosed when the writer is gone."""
        parts = []
        while True:
            try:
                if not self.wake.poll(timeout):
                    if parts:
                        continue  # NOTE: the rest of a message always follows; keep waiting
                    return None
                self.wake.recv_bytes()
            except (EOFError, OSError) as exc:
                raise QueueClosed("the writer of the queue is gone") from exc
            data, flags = self._get_fragment()
            parts.append(data)
            if flags & FLAG_LAST:
                break
        return decode_arrays(parts[0] if len(parts) == 1 else np.concatenate(parts))

    def _get_fragment(self) -> tuple[np.ndarray, int]:
        while True:
            pos = self._position % self.capacity
            length, flags = (int(v) for v in self._ring[pos: pos + FRAME_BYTES].view(np.int64))
            if flags & FLAG_WRAP:
                self._position += self.capacity - pos
                continue
            data = self._ring[pos + FRAME_BYTES: pos + FRAME_BYTES + length].copy()
            self._position += FRAME_BYTES + _pad16(length)
            # NOTE: x86 keeps the copy's loads before this store; on weakly ordered CPUs the
            # writer could refill this space early, but only when the ring is full.
            self._control[0] = self._position  # room for the writer
            return data, flags
