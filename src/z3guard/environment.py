"""What `z3guard env` reports: the releases in use, what z3guard would do with this DeepSpeed and why, and
whether the start-up hook is in place. The first thing to run, and to paste into a bug report."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import site
from pathlib import Path
from typing import Any

PACKAGES = ("z3guard", "deepspeed", "torch", "transformers", "accelerate")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def startup_hook() -> dict[str, Any]:
    """Where z3guard.pth is (if installed), and what the environment asks of it."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]  # where Python's start-up reads .pth files
    found = next((str(Path(d) / "z3guard.pth") for d in dirs if d and (Path(d) / "z3guard.pth").is_file()), None)
    from .options import from_environment

    text = os.environ.get("Z3GUARD_OPTIONS", "")
    try:
        options: Any = {k: v for k, v in vars(from_environment(text)).items()}
    except ValueError as exc:
        options = f"invalid: {exc}"
    enabled = os.environ.get("Z3GUARD", "").strip().lower() not in ("", "0", "off", "false", "no")
    return {"installed": found, "Z3GUARD": os.environ.get("Z3GUARD"), "enabled": enabled,
            "Z3GUARD_OPTIONS": text or None, "options": options}


def report() -> dict[str, Any]:
    out: dict[str, Any] = {"versions": {p: _version(p) for p in PACKAGES},
                           "python": platform.python_version(), "startup_hook": startup_hook()}
    from . import __version__

    out["versions"]["z3guard"] = __version__
    if out["versions"]["deepspeed"] is None:
        out["deepspeed"] = {"error": "DeepSpeed is not installed"}
        return out
    try:
        out["deepspeed"] = _deepspeed()
    except Exception as exc:  # reported, not raised: this is the command people run when things break
        out["deepspeed"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _deepspeed() -> dict[str, Any]:
    import deepspeed

    from .adapter import contract, releases, speedpaths
    from .adapter.lifecycle import detect

    entry = releases.tested(deepspeed.__version__)
    problems = contract.problems()
    info: dict[str, Any] = {
        "release": deepspeed.__version__,
        "tested": entry is not None,
        "tested_on": entry.tested_on if entry else None,
        "self_check": "passed" if not problems else problems,
        "crash_fix": "on" if not problems else "off (self-check failed: nothing would be patched)",
    }
    if problems:
        return info
    info["lifecycle"] = detect().describe()
    info["speed_paths"] = {p.name: {"on": speedpaths.why_off(p.name) is None,
                                    "why_off": speedpaths.why_off(p.name),
                                    "fingerprint": speedpaths.current(p.name)} for p in speedpaths.PATHS}
    return info
