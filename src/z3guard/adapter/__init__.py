"""The only door to DeepSpeed internals: pick the adapter for the installed release, or refuse."""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import sys

from packaging.version import Version

from .base import Adapter

# Each release here passed z3guard's tests (0.19.8 and 0.14.4 in CI on CPU; all three on 2 GPUs); a new
# release is added here, with the adapter module that fits it, once its tests pass. Others are refused:
# the adapters replace DeepSpeed internals that a patch release may change.
SUPPORTED: dict[str, str] = {"0.9.1": "v0_9", "0.14.4": "v0_14", "0.19.8": "v0_19"}


class UnsupportedDeepSpeed(RuntimeError):
    """The installed DeepSpeed is not one z3guard has an adapter for; nothing was patched."""


def supported_releases() -> str:
    return ", ".join(SUPPORTED)


def adapter_for(release: str) -> str:
    """The adapter module for `release` (a local build of a tested release, "0.19.8+<commit>", included)."""
    module = SUPPORTED.get(Version(release).public)
    if module is None:
        raise UnsupportedDeepSpeed(
            f"z3guard does not support DeepSpeed {release}; tested and supported releases: {supported_releases()}. "
            "Nothing was patched. Install a supported release, or run without z3guard.")
    return module


def installed_release() -> str:
    """The DeepSpeed release in use: its own `__version__` once imported (right also for a source tree on
    PYTHONPATH); before that (the CLI, the launcher) its package metadata, which spares the import."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"].__version__
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        import deepspeed

        return deepspeed.__version__


@functools.cache
def load() -> Adapter:
    import deepspeed

    module = importlib.import_module(f"{__name__}.{adapter_for(deepspeed.__version__)}")
    return module.ADAPTER
