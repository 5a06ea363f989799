"""The base of minisgl's layers and models."""

from typing import Any

from torch import nn


class Layer(nn.Module):
    """An nn.Module whose call goes straight to `forward`.

    NOTE: torch's Module.__call__ looks for hooks (per module and global) on every call, a cost
    a one-row CPU decode step feels (BENCHMARKS.md, "Module calls"). minisgl registers no
    hooks, and hooks registered on these modules are not run."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)
