"""Tensor-parallel ranks 1..N-1: spawning them, feeding them, watching them, stopping them.

Rank 0 (the server or `LLM` process) owns a `TPWorkers`: it spawns one process per other rank
(torch.multiprocessing, spawn context), gives each a `ShmQueue` and a status pipe, and hosts
the rendezvous (a TCPStore on a port the OS picks, so two instances on one host never clash).
Each worker sets its TP info, joins the process group, calls the `target` it was given (which
builds its own engine, loading only its weight shard, and returns a step function), then runs
every step message from its queue in order: the same forward as rank 0 on its shard, the
collectives lining up.

Sampling: only rank 0 samples. It broadcasts the sampled ids ([B] int32) at the end of every
forward, and every rank writes them into its own token pool, so the next step's input ids are
gathered identically everywhere. Workers thus keep no sampling state at all (no seeded
generators, penalties, min_new_tokens masks): one small broadcast per step buys correctness
for every sampling feature without mirroring any of them, and the logits are already gathered
on every rank by the vocab-parallel LM head.

Failure: a monitor thread on rank 0 waits on the process sentinels. A worker that dies (or
reports an error) sets `failed` and calls the failure listeners; the scheduler races its step
completions against that, fails the open requests and stops. Collectives carry a finite
timeout (GLOO_TIMEOUT_S); in practice a dead peer breaks gloo's sockets within milliseconds.
Workers ignore SIGINT (rank 0 orchestrates shutdown) and exit when rank 0 disappears (EOF on
their queue's pipe).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minisgl.distributed.context import TPInfo, create_group, set_tp_info
from minisgl.distributed.shm_queue import QueueClosed, ReaderHandle, ShmQueue

logger = logging.getLogger(__name__)

GLOO_TIMEOUT_S = 120.0  # bounds one collective; a dead peer usually breaks it in milliseconds
START_TIMEOUT_S = 600.0  # model load on every rank
STOP_TIMEOUT_S = 10.0
STORE_HOST = "127.0.0.1"
MSG_STOP = -1  # meta[0] of a message that ends the worker loop


@contextlib.contextmanager
def _main_module_hidden():
    """Spawned children re-run the parent's `__main__` (a user's script without an
    `if __name__ == "__main__"` guard would build another LLM there). Workers need nothing
    from it, so hide it from multiprocessing while the process starts."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__}
    try:
        for key in saved:
            setattr(main, key, None) if key == "__spec__" else delattr(main, key)
        yield
    finally:
        for key, value in saved.items():
            setattr(main, key, value)


def cpu_threads(size: int) -> int:
    """Intra-op threads per rank on CPU: the ranks share this host's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // size)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class TPWorkers:
    """Rank 0's view of ranks 1..N-1."""

    def __init__(self, size: int, device: torch.device, log_level: str,
                 target: Callable[[TPInfo, Any], Callable[[list], None]]) -> None:
        """`target(tp_info, group)` runs in each worker process (picklable: a module-level
        function or a partial of one) and returns the function that runs one step message."""
        self.size, self.device = size, device
        self.failed: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._monitor: threading.Thread | None = None
        self._errors: dict[int, str] = {}
        self._reap_lock = threading.Lock()
        self.store = dist.TCPStore(STORE_HOST, 0, size, True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        self.queues: list[ShmQueue] = []
        self.status: list[Connection] = []
        self.procs: list[mp.Process] = []
        ctx = mp.get_context("spawn")
        atexit.register(self.shutdown, graceful=False)  # an LLM never shut down
        try:
            for rank in range(1, size):
                queue = ShmQueue.create()
                self.queues.append(queue)
                status_r, status_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=run_worker, name=f"minisgl-tp{rank}", daemon=True,
                                   args=(target, rank, size, device, log_level,
                                         self.store.port, queue.reader_handle(), status_w))
                with _main_module_hidden():
                    proc.start()
                status_w.close()
                queue.forget_reader()
                self.status.append(status_r)
                self.procs.append(proc)
        except BaseException:
            self.shutdown(graceful=False)
            raise

    # ---- start-up ----------------------------------------------------------------------------

    def wait_for(self, what: str, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until every worker sent `what` on its status pipe; raise with the worker's own
        error when one fails or dies first."""
        pending = dict(zip(self.status, range(1, self.size)))
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"tensor-parallel workers {sorted(pending.values())} did "
                                   f"not become {what} within {timeout:.0f} s")
            sentinels = {self.procs[r - 1].sentinel: r for r in pending.values()}
            for ready in wait(list(pending) + list(sentinels), left):
                rank = pending.get(ready) or sentinels[ready]
                conn = self.status[rank - 1]
                message = self._read_status(conn)
                if message == what:
                    pending.pop(conn, None)
                elif message is None or message == "error":
                    raise RuntimeError(self.startup_error(rank))

    def _read_status(self, conn: Connection) -> str | None:
        try:
            if not conn.poll(0):
                return None
            kind, text = conn.recv()
        except (EOFError, OSError):
            return None
        if kind == "error":
            self._errors[self.status.index(conn) + 1] = text
        return kind

    def startup_error(self, rank: int) -> str:
        proc = self.procs[rank - 1]
        proc.join(timeout=5)
        self._read_status(self.status[rank - 1])
        error = self._errors.get(rank)
        detail = error.strip().splitlines()[-1] if error else f"it {_describe_exit(proc.exitcode)}"
        return f"tensor-parallel rank {rank} failed to start: {detail}"

    def first_error(self) -> str | None:
        """After a failed start: a worker's own error or death, which is usually the cause of
        what rank 0 saw (a broken collective), else None."""
        wait([p.sentinel for p in self.procs], timeout=0.5)  # a dying worker shows late
        for rank in range(1, self.size):
            self._read_status(self.status[rank - 1])
            if rank in self._errors:
                return self.startup_error(rank)
        death = self._death_message()
        return f"tensor-parallel start failed: {death}" if death else None

    def start_monitor(self) -> None:
        self._wake_r, self._wake_w = mp.get_context("spawn").Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._watch, name="minisgl-tp-monitor",
                                         daemon=True)
        self._monitor.start()

    # ---- steps -------------------------------------------------------------------------------

    def send(self, arrays: list) -> None:
        """Queue one step message for every worker (scheduler thread)."""
        try:
            for queue in self.queues:
                queue.put(arrays, alive=lambda: self.failed is None)
        except QueueClosed:
            self.mark_failed(self._death_message() or "a tensor-parallel worker is gone")
            raise

    # ---- failure -----------------------------------------------------------------------------

    def add_listener(self, callback: Callable[[str], None]) -> None:
        """`callback(message)` runs once on failure, on the monitor thread (at once if it
        already failed)."""
        with self._lock:
            failed = self.failed
            if failed is None:
                self._listeners.append(callback)
        if failed is not None:
            callback(failed)

    def remove_listener(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def mark_failed(self, message: str) -> None:
        with self._lock:
            if self.failed is not None or self._stopping:
                return
            self.failed = message
            listeners, self._listeners = self._listeners, []
        logger.error("%s", message)
        for callback in listeners:
            try:
                callback(message)
            except Exception:  # e.g. the listener's event loop is closed
                logger.exception("failure listener raised")

    def explain_failure(self, exc: BaseException) -> str:
        """Rank 0's collective raised (engine thread): a dead worker is the usual cause; give
        its exit a moment to show, then record and return the reason."""
        wait([p.sentinel for p in self.procs], timeout=1.0)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        self.mark_failed(self._death_message()
                         or f"a tensor-parallel collective failed on rank 0: {first}")
        return self.failed or first

    def _death_message(self) -> str | None:
        with self._reap_lock:  # NOTE: the monitor and the engine thread may both ask
            gone = set(wait([p.sentinel for p in self.procs], timeout=0))
            for rank, proc in enumerate(self.procs, start=1):
                if proc.sentinel in gone:
                    proc.join(timeout=2)  # its fds close before it can be reaped
                if proc.exitcode is None:
                    continue
                self._read_status(self.status[rank - 1])
                error = self._errors.get(rank)
                why = f": {error.strip().splitlines()[-1]}" if error else ""
                return (f"tensor-parallel worker rank {rank} (pid {proc.pid}) "
                        f"{_describe_exit(proc.exitcode)}{why}")
        return None

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self.procs]
        wait(sentinels + [self._wake_r])  # NOTE: blocks; no polling
        if self._stopping:
            return
        self.mark_failed(self._death_message() or "a tensor-parallel worker failed")

    # ---- shutdown ----------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every worker (graceful: a STOP message first; then SIGKILL) and remove every
        shared-memory segment. Idempotent. Not graceful after a failure or a failed start,
        where a worker may wait in a collective that will never complete."""
        atexit.unregister(self.shutdown)
        with self._lock:
            self._stopping = True
        if self._monitor is not None:
            try:
                self._wake_w.send_bytes(b"")
            except OSError:
                pass
            self._monitor.join(timeout=5)
            self._wake_r.close()
            self._wake_w.close()
            self._monitor = None
        for queue, proc in zip(self.queues, self.procs):
            if graceful and proc.is_alive():
                try:
                    queue.put([np.array([MSG_STOP], dtype=np.int64)], alive=proc.is_alive)
                except QueueClosed:
                    pass
        deadline = time.monotonic() + (STOP_TIMEOUT_S if graceful else 0.0)
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                if graceful:
                    logger.warning("tensor-parallel worker %s did not stop; killing it",
                                   proc.name)
                proc.kill()
                proc.join(timeout=5)
        for queue in self.queues:
            queue.close()
        for conn in self.status:
            conn.close()
        self.queues, self.status, self.procs = [], [], []
        self.store = None


# ---- the worker process ----------------------------------------------------------------------


def run_worker(target: Callable[[TPInfo, Any], Callable[[list], None]], rank: int, size: int,
               device: torch.device, log_level: str, store_port: int, handle: ReaderHandle,
               status: Connection) -> None:
    """Entry point of rank `rank`: join, build, then run steps until STOP or rank 0 is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    queue: ShmQueue | None = None
    try:
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads(size))
        else:
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        info = TPInfo(rank, size)
        store = dist.TCPStore(STORE_HOST, store_port, size, False,
                              timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        status.send(("joining", ""))
        group = create_group(store, rank, size, device, GLOO_TIMEOUT_S)
        set_tp_info(info, group)
        run_step = target(info, group)
        queue = ShmQueue.attach(handle)
        status.send(("ready", ""))
        with torch.inference_mode():
            while True:
                arrays = queue.get()
                if arrays is None:
                    continue
                if int(arrays[0][0]) == MSG_STOP:
                    break
                run_step(arrays)
    except QueueClosed:
        logger.info("rank 0 is gone; exiting")
        os._exit(1)
    except BaseException:
        text = traceback.format_exc()
        logger.error("tensor-parallel worker failed:\n%s", text)
        try:
            status.send(("error", text))
        except OSError:
            pass
        os._exit(1)  # NOTE: no interpreter teardown: a peer may hold us in a collective
    finally:
        if queue is not None:
            queue.close()
