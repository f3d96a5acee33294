"""Start a group of ranks with torchrun, watch their progress, and never hang."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from .job import Job


class LaunchError(RuntimeError):
    pass


@dataclass
class Launch:
    out: Path
    returncode: int
    seconds: float
    log: str

    def result(self, job: str, rank: int = 0) -> dict:
        path = self.out / f"{job}.rank{rank}.json"
        if not path.exists():
            raise LaunchError(f"job {job!r} left no result at {path} (exit {self.returncode}); log tail:\n"
                              + self.log[-4000:])
        return json.loads(path.read_text())

    def failure(self, job: str) -> dict | None:
        """Why `job` tells nothing: a rank's crash other than the trace failure under study (with its step
        and traceback), or a rank that left no result (with the log's tail); None when it ran or failed as
        studied."""
        found = sorted(self.out.glob(f"{job}.rank*.json"))
        for path in found:
            crash = json.loads(path.read_text()).get("crash")
            if crash and not crash.get("related", True):
                return {"run": job, "rank": int(path.stem.rsplit("rank", 1)[1]), **crash}
        if not found:
            return {"run": job, "rank": None, "step": None, "exception": "no result",
                    "summary": f"the ranks ended (exit {self.returncode}) before this run reported",
                    "user_frames": [], "traceback": self.log[-4000:]}
        return None

    def state(self, job: str):
        import torch

        return torch.load(self.out / f"{job}.state.pt")

    def loaded(self, job: str):
        """The gathered state right after `job`'s load_checkpoint (Job.state_after_load)."""
        import torch

        return torch.load(self.out / f"{job}.loaded.pt")

    def optimizer(self, job: str, rank: int):
        import torch

        return torch.load(self.out / f"{job}.optim.rank{rank}.pt")


def rank_env(device: str) -> dict[str, str]:
    from packaging.version import Version

    from ..adapter import installed_release

    env = dict(os.environ)
    release = installed_release()
    if Version(release) < Version("0.16"):
        # its checkpoint engine's torch.load predates torch 2.6's weights_only default (0.16 passes False)
        env.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # 2 ranks on 2 cores; on GPUs torchrun's own default
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("LOCAL_SIZE", "2")  # else the CPU accelerator shells out to numactl
        ext = Path(sys.prefix) / f"torch_extensions-ds{release}"
        env.setdefault("TORCH_EXTENSIONS_DIR", str(ext))
    else:
        env["DS_ACCELERATOR"] = "cuda"
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def default_launcher() -> str:
    """torchrun, or what `Z3GUARD_LAUNCHER` names (the test suite starts its ranks directly)."""
    return os.environ.get("Z3GUARD_LAUNCHER", "torchrun")


def run_jobs(jobs: list[Job], out: Path, device: str = "cpu", nproc: int = 2, timeout: float = 600,
             on_progress: Callable[[str, int], None] | None = None, env: dict[str, str] | None = None,
             launcher: str | None = None) -> Launch:
    """Run `jobs` in one fresh process group of `nproc` ranks; kill the whole group on timeout."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "device": device, "jobs": [j.to_dict() for j in jobs]}))
    progress = out / "progress.jsonl"
    progress.unlink(missing_ok=True)
    return run_ranks(["-m", "z3guard.scenarios.worker", str(spec)], out, device, nproc, timeout, on_progress, env,
                     launcher)


LAUNCHERS = ("torchrun", "deepspeed", "direct")


def launch_command(launcher: str, nproc: int, argv: list[str], device: str = "cpu",
                   environ: Mapping[str, str] = os.environ) -> list[str]:
    """`torchrun --standalone --nproc_per_node N <argv>`, or DeepSpeed's own launcher (`deepspeed
    --num_gpus N`), which hands ranks their place in the environment only (no `--local_rank`). ("direct"
    starts the ranks itself: see `run_ranks`.)"""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv]
    if launcher == "deepspeed":
        script = ["--module", *argv[1:]] if argv[0] == "-m" else argv
        return [sys.executable, "-m", "deepspeed.launcher.runner", *_deepspeed_devices(nproc, device, environ),
                "--no_local_rank", f"--master_port={_free_port()}", *script]
    raise ValueError(f"launcher: expected one of {', '.join(LAUNCHERS)}, got {launcher!r}")


def _deepspeed_devices(nproc: int, device: str, environ: Mapping[str, str]) -> list[str]:
    """DeepSpeed's runner drops CUDA_VISIBLE_DEVICES when given --num_gpus (ranks would then take GPUs
    0..N-1, where torchrun keeps to the visible ones): name the visible GPUs instead."""
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if device != "cuda" or not visible:
        return [f"--num_gpus={nproc}"]
    if len(visible) < nproc:
        raise ValueError(f"{nproc} ranks, but CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']} names "
                         f"{len(visible)} GPU(s)")
    return [f"--include=localhost:{','.join(visible[:nproc])}"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argv: list[str], out: Path, device: str = "cpu", nproc: int = 2, timeout: float = 600,
              on_progress: Callable[[str, int], None] | None = None, env: dict[str, str] | None = None,
              launcher: str | None = None) -> Launch:
    """A script or `-m module` on every rank of a fresh group (see `launch_command`). "direct" starts the
    ranks here with torchrun's rendezvous variables, without its agent (a torch import less per launch),
    and ends the others when one fails, as torchrun does."""
    launcher = launcher or default_launcher()
    out.mkdir(parents=True, exist_ok=True)
    progress = out / "progress.jsonl"
    environ = {**rank_env(device), **(env or {})}
    log_path = out / "launch.log"
    start = time.monotonic()
    with log_path.open("w") as log:
        if launcher == "direct":
            port = str(_free_port())
            procs = [subprocess.Popen([sys.executable, "-u", *argv], stdout=log, stderr=subprocess.STDOUT,
                                      env={**environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                                           "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                                           "MASTER_PORT": port}, start_new_session=True) for r in range(nproc)]
        else:
            procs = [subprocess.Popen(launch_command(launcher, nproc, argv, device, environ), stdout=log,
                                      stderr=subprocess.STDOUT, env=environ, start_new_session=True)]
        seen = 0
        try:
            while any(p.poll() is None for p in procs):
                if any(p.returncode for p in procs):  # a rank failed: the others would wait for it
                    break
                if time.monotonic() - start > timeout:
                    raise LaunchError(f"ranks ran past {timeout:.0f} s; killed (log: {log_path})")
                seen = _report(progress, seen, on_progress)
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    _kill_tree(p)
    _report(progress, seen, on_progress)
    reap_orphan_shm()
    code = next((p.returncode for p in procs if p.returncode), 0)
    return Launch(out, code, time.monotonic() - start, log_path.read_text(errors="replace"))


def _kill_tree(proc: subprocess.Popen) -> None:
    """The launcher and every rank: torchrun starts each rank in a session of its own, out of reach of a
    signal to the launcher's process group."""
    import psutil

    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        ranks = []
    os.killpg(proc.pid, signal.SIGKILL)
    for rank in ranks:
        try:
            rank.kill()
        except psutil.Error:
            pass
    proc.wait()


def reap_orphan_shm(min_age_s: float = 30.0) -> int:
    """Unlink DeepSpeed's CPU all-reduce buffers (/dev/shm/deepspeed_*) that no live process maps.

    DeepSpeed's shm comm op unlinks them only on a clean interpreter exit; ranks that are killed (or
    that skip teardown) leave 2 x 66 MiB per launch in RAM-backed /dev/shm for good."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return 0
    candidates = {p for p in shm.glob("deepspeed_*") if time.time() - p.stat().st_mtime > min_age_s}
    if not candidates:
        return 0
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split()[-1] for line in maps.read_text().splitlines() if "/dev/shm/" in line)
        except OSError:
            continue
    removed = 0
    for p in candidates:
        if str(p) not in mapped:
            p.unlink(missing_ok=True)
            removed += 1
    return removed


def _report(progress: Path, seen: int, on_progress) -> int:
    if on_progress is None or not progress.exists():
        return seen
    lines = progress.read_text().splitlines()
    for line in lines[seen:]:
        rec = json.loads(line)
        on_progress(rec["job"], rec["step"])
    return len(lines)
