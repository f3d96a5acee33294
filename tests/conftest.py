"""Multi-process helpers: every launch is a real torchrun group of 2 gloo ranks with a hard timeout."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Ranks started directly with torchrun's rendezvous variables: torchrun's agent costs a torch import per
# launch. Tests of launchers name theirs (torchrun, DeepSpeed's, accelerate's).
os.environ.setdefault("Z3GUARD_LAUNCHER", "direct")

from z3guard.scenarios.job import Job  # noqa: E402
from z3guard.scenarios.launch import Launch, run_jobs  # noqa: E402

LAUNCH_TIMEOUT = 420  # seconds for one group; a hang fails the test instead of the suite


def launch(jobs: list[Job], out: Path) -> Launch:
    result = run_jobs(jobs, out, device="cpu", nproc=2, timeout=LAUNCH_TIMEOUT)
    assert result.returncode == 0, f"rank group failed (exit {result.returncode}):\n{result.log[-6000:]}"
    return result


def scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks import model factories of tests/scripts/ by name (`checkpointed_lm:plain`)."""
    scripts = str(Path(__file__).parent / "scripts")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [scripts, os.environ.get("PYTHONPATH")])))


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")
