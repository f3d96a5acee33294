"""The DeepSpeed releases z3guard was run on end to end, and how: the one list the code, the tests and the
README's compatibility table (`python -m z3guard.adapter.releases`) all read.

Any other release is guarded when the self-check passes (contract.py), with one warning that it is
untested; the speed paths follow their fingerprints (speedpaths.py), not this list.
"""
from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version


@dataclass(frozen=True)
class Release:
    version: str
    tested_on: str
    """Where the crash scenarios ran: "CPU" (CI, 2 gloo ranks), "GPU" (H200, NCCL), or both."""
    torch: str
    """The torch it ran beside."""
    why: str = ""
    """Who pins it, or why it is here."""
    needs: tuple[str, ...] = ()
    """What it must have beside it in the CPU tests, where pip's resolution would pick wrong."""
    cpu_shim: bool = False
    """Its CPU accelerator needs Intel's extension and oneCCL, and it imports torch names since removed:
    the CPU tests run it with the small stand-ins of tests/shims (nothing of ZeRO-3 is replaced)."""


TESTED: tuple[Release, ...] = (
    Release("0.9.1", "GPU", "2.11", "the report's release; 0.9 has no CPU accelerator"),
    Release("0.10.3", "CPU", "2.13", needs=("pydantic<2", "numpy<2", "typer<0.13"), cpu_shim=True),
    Release("0.11.2", "CPU", "2.13", needs=("numpy<2",), cpu_shim=True),
    Release("0.12.6", "CPU", "2.13", needs=("numpy<2",), cpu_shim=True),
    Release("0.13.5", "CPU", "2.13", needs=("numpy<2",), cpu_shim=True),
    Release("0.14.4", "CPU", "2.13"),
    Release("0.14.5", "CPU", "2.13", "TRL's minimum"),
    Release("0.15.4", "CPU", "2.13"),
    Release("0.16.4", "CPU", "2.13", "LLaMA-Factory's recommended"),
    Release("0.16.9", "CPU", "2.13"),
    Release("0.17.6", "CPU", "2.13"),
    Release("0.18.4", "CPU", "2.13", "LLaMA-Factory's newest"),
    Release("0.18.9", "CPU", "2.13", "axolotl, ms-swift"),
    Release("0.19.5", "CPU", "2.13", "OpenRLHF"),
    Release("0.19.8", "CPU, GPU", "2.13 (CPU), 2.11 (GPU)", "newest"),
)
BY_VERSION = {r.version: r for r in TESTED}


def tested(release: str) -> Release | None:
    """The entry for `release`; a local build or post-release of a tested one (0.19.8+abc) is not it."""
    return BY_VERSION.get(release)


def speed_paths_on(release: str) -> list[str]:
    """The speed paths verified on `release` (those whose VERIFIED fingerprints name it)."""
    from .speedpaths import VERIFIED

    return [name for name, prints in VERIFIED.items() if any(release in on for on in prints.values())]


def markdown() -> str:
    """The README's compatibility table."""
    lines = ["| DeepSpeed | tested on | torch | speed paths on | notes |", "|---|---|---|---|---|"]
    for r in sorted(TESTED, key=lambda r: Version(r.version)):
        paths = speed_paths_on(r.version)
        where = r.tested_on + (" (test shims)" if r.cpu_shim else "")
        lines.append(f"| {r.version} | {where} | {r.torch} | {', '.join(paths) if paths else 'none (crash fix only)'} "
                     f"| {r.why} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
