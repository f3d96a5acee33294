"""Fault injection for the save path, used by the tests: Z3GUARD_KILL_AT=<point>[@<tag>][:<rank>]
makes that rank (default 0) SIGKILL itself at that point of a save (of that tag), as a crashed node
would; Z3GUARD_FAIL_AT=... of the same form raises an I/O error there instead, as a failing disk
would. Unset, it costs two environment lookups per point."""
from __future__ import annotations

import errno
import os
import re
import signal

from . import dist

POINTS = ("before-data", "mid-data", "before-manifest", "before-rename", "before-latest")
WRITE_BACK = "write-back"  # after the save returned: its files going to disk on a thread of their own


def point(name: str, tag: str) -> None:
    for variable in ("Z3GUARD_KILL_AT", "Z3GUARD_FAIL_AT"):
        spec = os.environ.get(variable)
        m = re.fullmatch(r"([a-z-]+)(?:@([^:]+))?(?::(\d+))?", spec) if spec else None
        if m and m.group(1) == name and m.group(2) in (None, tag) and dist.rank() == int(m.group(3) or 0):
            if variable == "Z3GUARD_KILL_AT":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.EIO, f"injected I/O error at {name} of checkpoint '{tag}'")
