"""GGUF files through the gguf package's reader, its per-value reads made cheap.

The reader parses every metadata value (a tokenizer's vocabulary and merges) as one slice of
the file's numpy memmap each, and a memmap slice pays memmap's __array_finalize__; one
conversion opens a file several times (ours and transformers' readers). A plain ndarray view of
the same mapping slices to the same bytes for less (BENCHMARKS.md, "Opening a GGUF file").
`install` gives the reader class that read, once and process-wide (transformers' readers
included): the arrays it returns are plain ndarray views of the mapping, not memmaps.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np

# the private method's signature this replacement was written against: another gguf release
# keeps its own reads
_GET_PARAMETERS = ["self", "offset", "dtype", "count", "override_order"]
stock_get: Any = None  # the reader's own, once replaced


def _get(self: Any, offset: int, dtype: Any, count: int = 1,
         override_order: str | None = None) -> np.ndarray:
    plain = self.__dict__.get("_plain_data")
    if plain is None:
        plain = self._plain_data = self.data.view(np.ndarray)
    count, dtype = int(count), np.dtype(dtype)
    values = plain[offset:offset + dtype.itemsize * count].view(dtype=dtype)[:count]
    order = self.byte_order if override_order is None else override_order
    return values.view(values.dtype.newbyteorder(order))


def install() -> None:
    from gguf import GGUFReader
    current = GGUFReader._get
    if current is not _get and list(inspect.signature(current).parameters) == _GET_PARAMETERS:
        global stock_get
        stock_get = current
        GGUFReader._get = _get


def gguf_reader(path: Path | str) -> Any:
    """A gguf.GGUFReader of `path`, with the cheap reads installed."""
    from gguf import GGUFReader
    install()
    return GGUFReader(str(path))
