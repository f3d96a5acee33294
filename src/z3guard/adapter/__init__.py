"""The only door to DeepSpeed internals: pick the adapter for the installed release, or refuse."""
from __future__ import annotations

import functools
import importlib

from packaging.version import Version

from .base import Adapter

# (first release, first release no longer covered, adapter module). Each range was tested, not assumed.
SUPPORTED: list[tuple[str, str, str]] = [
    ("0.9.1", "0.10.0", "v0_9"),  # GPU only (no CPU accelerator in 0.9): validated on 2 H200s
    ("0.14.4", "0.15.0", "v0_14"),
    ("0.19.8", "0.20.0", "v0_19"),
]


class UnsupportedDeepSpeed(RuntimeError):
    """The installed DeepSpeed is not one z3guard has an adapter for; nothing was patched."""


def supported_releases() -> str:
    return ", ".join(f">={lo},<{hi}" for lo, hi, _ in SUPPORTED)


def adapter_for(release: str) -> str:
    v = Version(release)
    for lo, hi, module in SUPPORTED:
        if Version(lo) <= v < Version(hi):
            return module
    raise UnsupportedDeepSpeed(
        f"z3guard does not support DeepSpeed {release}; supported releases: {supported_releases()}. "
        "Nothing was patched. Install a supported release, or run without z3guard.")


@functools.cache
def load() -> Adapter:
    import deepspeed

    module = importlib.import_module(f"{__name__}.{adapter_for(deepspeed.__version__)}")
    return module.ADAPTER
