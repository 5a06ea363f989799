"""The adapters the scheduler serves (--enable-lora): names, and which adapter sits in each of
the engine's --max-loras-per-batch slots.

Every running request decodes in every decode step, so the adapters of all admitted requests
must fit the slots at once: a request whose adapter would need a slot that admitted requests
hold waits (requests of other adapters pass it). An adapter stays in its slot after its
requests finish, until the slot is needed again (least recently used first; pinned adapters
never leave theirs). A slot is filled by the step that first needs it (engine.lora).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from minisgl.core import Req
from minisgl.errors import InvalidRequest


LORA_OFF = "lora_path and LoRA adapters need a server started with --enable-lora"
UNLOAD_POLL_S = 0.02  # an unload waits for the adapter's requests in flight


@dataclass(frozen=True)
class Adapter:
    uid: int  # never reused: a name loaded again is another adapter (and prefix-cache key)
    name: str
    path: str
    pinned: bool


class AdapterTable:
    def __init__(self, slots: int, max_loaded: int | None) -> None:
        self.max_loaded = max_loaded
        self.by_name: dict[str, Adapter] = {}
        self.slot_uids: list[int] = [0] * slots  # 0: empty
        self.slot_used: list[int] = [0] * slots  # the admission clock at last use (LRU)
        self.active: Counter[int] = Counter()  # uid -> admitted requests using it
        self.pending: list[tuple[int, int, str]] = []  # slot loads for the next step
        # NOTE: also an unloaded adapter until its requests finished (they still need a slot)
        self._by_uid: dict[int, Adapter] = {}
        self._uids = itertools.count(1)
        self._clock = 0

    # ---- names ---------------------------------------------------------------------------------

    def check_new(self, name: str, pinned: bool) -> None:
        """Whether `add` would take it; raises InvalidRequest."""
        if not isinstance(name, str) or not name:
            raise InvalidRequest("lora_name must be a non-empty string")
        if name in self.by_name:
            raise InvalidRequest(f"a LoRA adapter named {name!r} is already loaded; unload it "
                                 "first")
        if self.max_loaded is not None and len(self.by_name) >= self.max_loaded:
            raise InvalidRequest(f"{self.max_loaded} LoRA adapters are loaded "
                                 "(--max-loaded-loras); unload one first")
        if pinned and sum(a.pinned for a in self.by_name.values()) + 1 >= len(self.slot_uids):
            raise InvalidRequest(f"at most {len(self.slot_uids) - 1} adapters may be pinned "
                                 "(--max-loras-per-batch - 1)")

    def new_uid(self) -> int:
        return next(self._uids)

    def add(self, uid: int, name: str, path: str, pinned: bool) -> Adapter:
        """Register adapter `uid` (from new_uid, read and checked by the engine); raises
        InvalidRequest."""
        self.check_new(name, pinned)
        adapter = Adapter(uid, name, path, pinned)
        self.by_name[name] = self._by_uid[uid] = adapter
        return adapter

    def remove(self, name: str) -> Adapter:
        """Forget a name (new requests cannot use it); raises InvalidRequest."""
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise InvalidRequest(f"no LoRA adapter named {name!r} is loaded")
        return adapter

    def evict(self, uid: int) -> None:
        """Once no request uses a removed adapter: free its slot."""
        for slot, held in enumerate(self.slot_uids):
            if held == uid:
                self.slot_uids[slot] = 0
        self._by_uid.pop(uid, None)

    def uid_of(self, name: str | None) -> int:
        """0 for the base model; a loaded adapter's uid, by name (or by path, as SGLang's
        lora_path once was); raises InvalidRequest."""
        if name is None:
            return 0
        if not self.slot_uids:
            raise InvalidRequest(LORA_OFF)
        adapter = self.by_name.get(name) or next(
            (a for a in self.by_name.values() if a.path == name), None)
        if adapter is None:
            loaded = ", ".join(sorted(self.by_name)) or "none"
            raise InvalidRequest(f"unknown LoRA adapter {name!r} (loaded: {loaded})")
        return adapter.uid

    # ---- slots ---------------------------------------------------------------------------------

    def can_admit(self, uid: int) -> bool:
        return uid == 0 or self.active[uid] > 0 or uid in self.slot_uids or (
            self._free_slot() is not None)

    def admit(self, uid: int) -> None:
        """A request of adapter `uid` takes a table row: its adapter must be in a slot."""
        if uid == 0:
            return
        self._clock += 1
        if uid not in self.slot_uids:
            slot = self._free_slot()
            assert slot is not None, "admitted without a free adapter slot (can_admit)"
            self.slot_uids[slot] = uid
            self.pending.append((slot, uid, self._by_uid[uid].path))
        self.slot_used[self.slot_uids.index(uid)] = self._clock
        self.active[uid] += 1

    def release(self, uid: int) -> None:
        if uid:
            self.active[uid] -= 1
            if not self.active[uid]:
                del self.active[uid]

    def row_slots(self, reqs: list[Req]) -> list[int] | None:
        """Each request's adapter slot (-1: none), or None when no admitted request uses an
        adapter (a batch of the base model alone)."""
        if not self.active:
            return None
        slots = [self.slot_uids.index(r.lora_uid) if r.lora_uid else -1 for r in reqs]
        return slots if max(slots) >= 0 else None

    def take_loads(self) -> list[tuple[int, int, str]]:
        loads, self.pending = self.pending, []
        return loads

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one no admitted request and no pin
        holds; None if every slot is held."""
        free = [slot for slot, uid in enumerate(self.slot_uids)
                if uid == 0 or (self.active[uid] == 0 and not self._pinned(uid))]
        return min(free, key=lambda s: (self.slot_uids[s] != 0, self.slot_used[s]),
                   default=None)

    def _pinned(self, uid: int) -> bool:
        adapter = self._by_uid.get(uid)
        return (adapter is not None and adapter.pinned
                and self.by_name.get(adapter.name) is adapter)  # NOTE: unloaded: pin gone


def add_adapter(table: AdapterTable, engine_lora: Any, name: str, path: str,
                pinned: bool) -> Adapter:
    """load_adapter on the calling thread (the --lora-paths adapters, at start)."""
    uid = _new_adapter(table, engine_lora, name, path, pinned)
    return _serve(table, engine_lora, uid, name, path, pinned, _read(engine_lora, uid, path))


async def load_adapter(table: AdapterTable, engine_lora: Any, name: str, path: str,
                       pinned: bool) -> Adapter:
    """Read and check an adapter off the loop thread, then serve it under `name`; raises
    InvalidRequest (LoRA off, a taken name, an adapter minisgl cannot serve)."""
    uid = _new_adapter(table, engine_lora, name, path, pinned)
    error = await asyncio.to_thread(_read, engine_lora, uid, path)
    return _serve(table, engine_lora, uid, name, path, pinned, error)


def _new_adapter(table: AdapterTable, engine_lora: Any, name: str, path: str,
                 pinned: bool) -> int:
    if engine_lora is None:
        raise InvalidRequest(LORA_OFF)
    if not isinstance(path, str) or not path:
        raise InvalidRequest("lora_path must be a non-empty string")
    table.check_new(name, pinned)
    return table.new_uid()


def _read(engine_lora: Any, uid: int, path: str) -> str | None:
    """The engine reads and checks it; the reason it cannot serve it, or None."""
    try:
        engine_lora.register(uid, path)
    except ValueError as exc:  # models.peft.AdapterError and the engine's checks
        return str(exc)
    return None


def _serve(table: AdapterTable, engine_lora: Any, uid: int, name: str, path: str,
           pinned: bool, error: str | None) -> Adapter:
    if error is not None:
        raise InvalidRequest(f"cannot load LoRA adapter {name!r}: {error}")
    try:
        return table.add(uid, name, path, pinned)
    except InvalidRequest:  # the same name was loaded meanwhile
        engine_lora.drop(uid)
        raise


async def unload_adapter(table: AdapterTable, engine_lora: Any, name: str,
                         in_use: Callable[[int], bool]) -> Adapter:
    """Stop serving `name` at once (new requests naming it are refused); its requests in
    flight finish first, then its slot and weights are freed."""
    if engine_lora is None:
        raise InvalidRequest(LORA_OFF)
    adapter = table.remove(name)
    while in_use(adapter.uid):
        await asyncio.sleep(UNLOAD_POLL_S)
    table.evict(adapter.uid)
    engine_lora.drop(adapter.uid)
    return adapter
