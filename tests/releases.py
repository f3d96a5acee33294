"""Run the release-sensitive tests on every CPU-tested DeepSpeed release, one after another in one
environment, swapping DeepSpeed between runs (a pure-Python install: seconds once pip has built it).

    python tests/releases.py [--full] [RELEASE ...]    # default: the releases of CI; --full: all but the main one

The main release (requirements-cpu.txt) runs the whole suite in its own environment. Here, by default (what
CI runs), the releases of CI run the self-check and lifecycle tests (tests/test_adapter.py), and those of
SCENARIO also the report's crash scenario (stock crashes, z3guard completes bit-identically), and those of
GENERATE generate() between training steps (tests/test_generate.py), and those of SPEED the speed paths
they have at 3 and 4 ranks (tests/test_world_sizes.py). With --full (`make
test-releases-full`, when a release is added or the adapter changes) every CPU-tested release runs them,
the scenario in fp16 and bf16, the `GatheredParameters` trigger, the save/load contract and the gathers.
Each release's compiled ops are kept in ~/.cache/z3guard, so that a machine's later runs skip compiling.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from z3guard.adapter.releases import TESTED  # noqa: E402

SELF_CHECK = ["tests/test_adapter.py"]
FULL = [*SELF_CHECK, "tests/test_matrix.py", "tests/test_contract.py", "tests/test_gather.py", "tests/test_generate.py"]
# One release of each coordinator lifecycle beside the main one: the oldest (a coordinator per mode) and the
# first pinned release with one coordinator for both (LLaMA-Factory's). --full runs every release.
SCENARIO = {"0.10.3", "0.16.4"}
# A release where stock fails on generate() between training steps (tests/test_generate.py), in CI; --full
# runs it on every release.
GENERATE = {"0.18.9"}
# Releases with speed paths on besides the main one: those paths against stock at 3 and 4 ranks
# (tests/test_world_sizes.py), in CI too.
SPEED = {"0.19.5"}
MAIN = next(line.split("==")[1].strip() for line in (ROOT / "requirements-cpu.txt").read_text().splitlines()
            if line.startswith("deepspeed=="))
DEFAULTS = {"pydantic": "pydantic>=2", "numpy": "numpy==2.4.6", "typer": "typer==0.29.2"}  # what a release does not ask otherwise
PIP = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-build-isolation"]


# CI's self-check: the oldest, the last of the coordinator per mode (TRL's minimum), LLaMA-Factory's and
# the newest two before the main one (0.18.9, OpenRLHF's 0.19.5). --full takes every CPU-tested release.
CI = {"0.10.3", "0.14.5", "0.16.4", "0.18.9", "0.19.5"}


def cpu_releases(full: bool = False) -> list[str]:
    return [r.version for r in TESTED if "CPU" in r.tested_on and r.version != MAIN and (full or r.version in CI)]


def tests_for(release: str, full: bool) -> tuple[list[str], str]:
    """The test files and the matrix's case set (tests/matrix.py) for `release`."""
    if full:
        return FULL + (["tests/test_world_sizes.py"] if release in SPEED else []), "1"
    tests = SELF_CHECK + (["tests/test_matrix.py"] if release in SCENARIO else []) + \
        (["tests/test_generate.py"] if release in GENERATE else []) + \
        (["tests/test_world_sizes.py"] if release in SPEED else [])
    return tests, "fast"


def run(release: str, full: bool = False) -> tuple[bool, str]:
    entry = next(r for r in TESTED if r.version == release)
    tests, cases = tests_for(release, full)
    env = dict(os.environ, DS_BUILD_OPS="0", DS_ACCELERATOR="cpu", Z3GUARD_RELEASE_MATRIX=cases,
               TORCH_EXTENSIONS_DIR=str(Path.home() / ".cache" / "z3guard" / "torch_extensions"
                                        / f"py{sys.version_info[0]}{sys.version_info[1]}-ds{release}"))
    if entry.cpu_shim:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "shims"), env.get("PYTHONPATH")]))
    pinned = {name: spec for name, spec in DEFAULTS.items() if not any(n.startswith(name) for n in entry.needs)}
    needs = [*entry.needs, *pinned.values()]
    for packages in (needs, [f"deepspeed=={release}", *needs]):  # its setup imports it: needs go first
        installed = subprocess.run([*PIP, *packages, "torch==2.13.0"], env=env, capture_output=True, text=True)
        if installed.returncode != 0:
            return False, f"install failed: {installed.stderr[-2000:]}"
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=8"]
    tested = subprocess.run([*pytest, *tests], cwd=ROOT,
                            env=env, capture_output=True, text=True)
    log = ROOT / "runs" / "releases" / f"{release}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(tested.stdout + tested.stderr)
    summary = (tested.stdout.strip().splitlines() or ["(no output)"])[-1]
    if tested.returncode != 0:
        failed = [line for line in tested.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return False, "\n".join(failed) + f"\n{tested.stdout[-4000:]}\n(whole output: {log})"
    return True, summary


def main(argv: list[str]) -> int:
    full = "--full" in argv
    releases = [a for a in argv if a != "--full"] or cpu_releases(full)
    passed, failed = [], []
    for release in releases:
        start = time.monotonic()
        ok, detail = run(release, full)
        print(f"DeepSpeed {release}: {'ok' if ok else 'FAILED'} in {time.monotonic() - start:.0f} s: "
              f"{detail if ok else ''}", flush=True)
        if not ok:
            print(detail, flush=True)
        (passed if ok else failed).append(release)
    print(f"releases: {len(passed)} passed, {len(failed)} failed" + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
