"""The engine's side of the hierarchical prefix cache (--enable-hierarchical-cache): building
rank 0's page store (kvcache.page_store) and the copies a step makes between the KV pool and
it (`KVMoves`, run by `KVTiers` at the start of the forward, on every rank).

A page's payload holds every rank's share of it: a save gathers the ranks' rows to rank 0,
which hands them to the store's thread; a load broadcasts rank 0's payloads and each rank
writes its share. The copies run before the step's layers write any KV: its saves first (a
page saved may have been freed and handed to this very step), then its loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from minisgl.distributed.context import TPInfo, all_gather_last_dim, broadcast
from minisgl.engine.config import EngineConfig
from minisgl.env import cache_root
from minisgl.flag_checks import hicache_extra_config, parse_size
from minisgl.kvcache import KVPool
from minisgl.kvcache.page_store import DiskTier, HostTier, PageStore, Tier
from minisgl.version import __version__

logger = logging.getLogger(__name__)

STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
MAX_SIZE_ENV = "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"
DEFAULT_DISK_BYTES = 16 * 2**30
PAGE_FORMAT = 1  # bump when what a page's payload holds changes


@dataclass
class KVMoves:
    """One step's copies. `save_keys` and `load_payloads` ([pages, tp * page_bytes] uint8,
    host) are rank 0's; the other ranks get the page ids only."""

    save_pages: list[int]
    load_pages: list[int]
    save_keys: list[bytes] | None = None
    load_payloads: torch.Tensor | None = None


class KVTiers:
    def __init__(self, pool: KVPool, tp: TPInfo, store: PageStore | None) -> None:
        self.pool, self.tp, self.store = pool, tp, store  # the store: rank 0's

    def run(self, moves: KVMoves) -> None:
        pool, device = self.pool, self.pool.layer(0)[0].device
        if moves.save_pages:
            rows = all_gather_last_dim(pool.read_pages(torch.tensor(moves.save_pages,
                                                                    device=device)))
            if self.store is not None:
                assert moves.save_keys is not None
                self.store.save(moves.save_keys, *_to_host(rows))
        if moves.load_pages:
            width = pool.page_bytes
            if moves.load_payloads is not None:
                payloads = moves.load_payloads.to(device, non_blocking=True)
            else:
                payloads = torch.empty((len(moves.load_pages), self.tp.size * width),
                                       dtype=torch.uint8, device=device)
            broadcast(payloads, 0)
            mine = payloads[:, self.tp.rank * width:(self.tp.rank + 1) * width]
            pool.write_pages(torch.tensor(moves.load_pages, device=device), mine.contiguous())


def _to_host(rows: torch.Tensor) -> tuple[torch.Tensor, object]:
    """A host copy of `rows` and what the store's thread calls before reading it (on CUDA the
    copy runs on the engine stream: its event's synchronize)."""
    if rows.device.type != "cuda":
        return rows, None
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event.synchronize


def kv_fingerprint(config: EngineConfig, model_path: Path, pool: KVPool) -> bytes:
    """What a page's KV depends on besides its tokens: the model (its files' names, sizes and
    times), how it is loaded and computed, and how the pool lays a page out."""
    files = [model_path] if model_path.is_file() else sorted(model_path.iterdir())
    if config.model_path is not None and Path(config.model_path).is_file():
        files.append(Path(config.model_path))
    stats = []
    for path in files:
        if path.is_file():
            stat = path.stat()
            stats.append((path.name, stat.st_size, stat.st_mtime_ns))
    identity = {
        "minisgl": __version__, "format": PAGE_FORMAT,
        "model": str(model_path.resolve()), "files": stats,
        "override": config.json_model_override_args, "load_format": config.load_format,
        "quantization": config.quantization, "dtype": config.dtype,
        "int8_activations": config.cpu_int8_activations,
        "seed": config.seed if config.load_format == "dummy" else None,  # random weights
        "kv_cache_dtype": config.kv_cache_dtype, "page_size": config.page_size,
        "tp_size": config.tp_size, "layout": [list(s) for s in pool.layout.shapes],
        "latent": pool.layout.latent, "page_bytes": pool.page_bytes,
    }
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=16).digest()


def build_page_store(config: EngineConfig, pool: KVPool, fingerprint: bytes,
                     device: torch.device) -> PageStore | None:
    """Rank 0's tiers (None where no tier applies: CPU without --hicache-size or a disk)."""
    payload_bytes = pool.page_bytes * config.tp_size
    tiers: list[Tier] = []
    host_bytes = config.hicache_size * 10**9
    if device.type == "cuda" and not host_bytes:
        host_bytes = int(config.hicache_ratio * pool.nbytes * config.tp_size)
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if host_bytes > free // 2:
        logger.warning("hierarchical cache: a %.1f GiB host tier would take more than half the "
                       "free memory; %.1f GiB instead", host_bytes / 2**30, free / 2**31)
        host_bytes = free // 2
    if host_bytes:
        tiers.append(HostTier(host_bytes, pin=device.type == "cuda"))
    if config.hicache_storage_backend == "file":
        extra = hicache_extra_config(config.hicache_storage_backend_extra_config)
        root = Path(config.hicache_storage_dir or extra.get("storage_dir")
                    or os.environ.get(STORAGE_DIR_ENV) or cache_root() / "hicache").expanduser()
        root.mkdir(parents=True, exist_ok=True)
        limit = extra.get("max_size", os.environ.get(MAX_SIZE_ENV))
        max_bytes = (parse_size(limit) if limit is not None
                     else min(DEFAULT_DISK_BYTES, shutil.disk_usage(root).free // 2))
        tiers.append(DiskTier(root / fingerprint.hex(), payload_bytes, max_bytes))
        if config.page_size < 16:
            logger.warning("hierarchical cache: a file per page of %d tokens; --page-size 16 or "
                           "more reads and writes far fewer files", config.page_size)
    if not tiers:
        logger.info("hierarchical cache: no tier on CPU (the KV pool is host memory already): "
                    "add --hicache-storage-backend file for a disk tier")
        return None
    logger.info("hierarchical cache: %s", ", ".join(
        f"{tier.name} {tier.max_bytes / 2**30:.2f} GiB" for tier in tiers))
    return PageStore(tiers, payload_bytes, pin=device.type == "cuda")
