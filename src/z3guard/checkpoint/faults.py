"""Fault injection for the save path, used by the tests: Z3GUARD_KILL_AT=<point>[@<tag>][:<rank>]
makes that rank (default 0) SIGKILL itself at that point of a save (of that tag), as a crashed node
would. Unset, it costs one environment lookup per point."""
from __future__ import annotations

import os
import re
import signal

from . import dist

POINTS = ("before-data", "mid-data", "before-manifest", "before-rename", "before-latest")


def point(name: str, tag: str) -> None:
    spec = os.environ.get("Z3GUARD_KILL_AT")
    if not spec:
        return
    m = re.fullmatch(r"([a-z-]+)(?:@([^:]+))?(?::(\d+))?", spec)
    if m and m.group(1) == name and m.group(2) in (None, tag) and dist.rank() == int(m.group(3) or 0):
        os.kill(os.getpid(), signal.SIGKILL)
