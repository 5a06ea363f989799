"""CPU kernels (paged decode attention, add + RMSNorm) compiled on first use (torch's C++ extension loader; needs a C++
compiler and ninja). When they cannot be built, callers fall back to plain torch ops."""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
STALE_LOCK_S = 600.0  # a build takes ~30 s; an older lock was left by a killed process


@functools.lru_cache(maxsize=1)
def cpu_kernels() -> Any | None:
    if os.environ.get("MINISGL_DISABLE_CPU_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        from minisgl.models.weights import cache_root
        build = cache_root() / "kernels"
        build.mkdir(parents=True, exist_ok=True)
        _remove_stale_lock(build / "lock")
        return load(name="minisgl_cpu_kernels", sources=[str(SOURCE)],
                    build_directory=str(build), extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, an unsupported platform
        logger.warning("CPU kernels unavailable (%s); using torch ops",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def _remove_stale_lock(lock: Path) -> None:
    """torch's extension loader waits forever on the lock file of a build that was killed."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            logger.warning("removed a stale kernel build lock (%s)", lock)
    except FileNotFoundError:
        pass
