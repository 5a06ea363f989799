"""CPU kernels (paged decode attention, add + RMSNorm, silu * up, rotary, 4/8-bit block
matmul, W8A8 int8 matmul, experts' grouped matmul, every GGUF block type's matmul, multi-LoRA,
a Llama or Granite 4.0-H model's GGUF decoder layers in one call, a hybrid model's Gated
DeltaNet and Mamba2 layers over spans of tokens) compiled on first use by torch's C++
extension loader (needs a C++ compiler and ninja). When they cannot be built, callers fall
back to plain torch ops."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import time
from pathlib import Path
from typing import Any

from minisgl.env import cache_root, cpu_kernels_disabled

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("cpu_kernels.cpp", "decode_bf16.cpp", "quant_matmul.cpp",
                                        "int8_matmul.cpp", "expert_matmul.cpp",
                                        "block_matmul.cpp", "lora_matmul.cpp",
                                        "fused_layers.cpp", "fused_one_row.cpp",
                                        "hybrid_state.cpp")]
HEADERS = sorted(CSRC.glob("*.h"))
NAME = "minisgl_cpu_kernels"
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
STALE_LOCK_S = 300.0  # a build lock this old was left by a killed build


@functools.lru_cache(maxsize=1)
def cpu_kernels() -> Any | None:
    if cpu_kernels_disabled():
        return None
    try:
        build = build_folder()
        built = _import_built(build)
        if built is not None:
            return built
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        _wait_for_other_build(build / "lock")
        started = time.perf_counter()
        fresh = not (build / f"{NAME}.so").exists()
        if fresh:  # NOTE: a newcomer's first start would otherwise sit silent for a minute
            logger.info("compiling the CPU kernels into %s (first start only: about a minute)",
                        build)
        module = load(name=NAME, sources=[str(p) for p in SOURCES], build_directory=str(build),
                      extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
        if fresh:
            logger.info("CPU kernels compiled in %.0f s", time.perf_counter() - started)
        return module
    except Exception as exc:  # no compiler, no ninja, an unsupported platform
        logger.warning("CPU kernels unavailable (%s); using torch ops",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def _import_built(build: Path) -> Any | None:
    """The module a finished build left, imported without torch's loader: the loader takes the
    folder's lock even when nothing needs building, and a process killed while holding it
    (a test's server torn down at start-up) would stall every later start on the lock."""
    library = build / f"{NAME}.so"
    if (build / "lock").exists() or not library.exists():
        return None
    import torch  # noqa: F401  (the module links against the libraries torch loads)

    try:
        spec = importlib.util.spec_from_file_location(NAME, library)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError:  # a library cut short by a killed link: build it again
        return None


def build_folder() -> Path:
    """The cache folder of this checkout's kernels. NOTE: one per source, flags, source folder
    and torch version: ninja's build commands name the sources' paths, so two checkouts sharing
    one folder would rebuild it in turn, and a module built against another torch would not
    load."""
    import torch

    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)
                            + " ".join(CFLAGS).encode() + str(CSRC).encode()
                            + torch.__version__.encode()).hexdigest()
    return cache_root() / "kernels" / digest[:16]


def _wait_for_other_build(lock: Path) -> None:
    """torch's loader waits forever on the lock of a build that was killed: wait while another
    build may still be running, then remove the lock it left."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            logger.warning("removed a stale kernel build lock (%s)", lock)
            return
        time.sleep(1.0)
