"""CPU kernels (paged decode attention, add + RMSNorm) compiled on first use (torch's C++ extension loader; needs a C++
compiler and ninja). When they cannot be built, callers fall back to plain torch ops."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"


@functools.lru_cache(maxsize=1)
def cpu_kernels() -> Any | None:
    if os.environ.get("MINISGL_DISABLE_CPU_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        from minisgl.models.weights import cache_root
        build = cache_root() / "kernels"
        build.mkdir(parents=True, exist_ok=True)
        return load(name="minisgl_cpu_kernels", sources=[str(SOURCE)],
                    build_directory=str(build), extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, an unsupported platform
        logger.warning("CPU kernels unavailable (%s); using torch ops",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
