"""The only door to DeepSpeed internals: check the installed DeepSpeed's code, then build its adapter.

Which release is installed decides nothing here: its code does. The self-check (contract.py) must pass
for the crash fix to be applied; the lifecycle (lifecycle.py) is read from the code; each speed path
runs only where its stock code matches what it was verified on (speedpaths.py). The tested releases
(releases.py) are the ones where all of that was run end to end.
"""
from __future__ import annotations

import functools
import importlib.metadata
import sys

from .base import Adapter


class IncompatibleDeepSpeed(RuntimeError):
    """The installed DeepSpeed lacks an internal the crash fix needs; nothing was patched."""


UnsupportedDeepSpeed = IncompatibleDeepSpeed  # the name of earlier releases of z3guard


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
    """The adapter for the installed DeepSpeed; raises IncompatibleDeepSpeed (patching nothing) when the
    self-check fails."""
    from . import contract

    found = contract.problems()
    if found:
        raise IncompatibleDeepSpeed(
            f"DeepSpeed {installed_release()} does not have the internals z3guard's crash fix relies on: "
            + "; ".join(found) + ". Nothing was patched.")
    from .common import ZeroAdapter
    from .lifecycle import detect

    return ZeroAdapter(detect())
