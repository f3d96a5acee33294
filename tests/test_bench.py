"""The benchmark harness's CPU smoke run (small sizes; the numbers that count come from GPUs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "run.py"
FIELDS = {"model", "variant", "offload", "median_step_s", "min_step_s", "peak_gpu_mem_bytes", "invalidations",
          "device", "deepspeed", "date", "tokens_per_s", "host_rss_bytes", "trace_switches", "steps",
          "phase_median_s", "host_peak_rss_bytes", "model_flops_per_token", "mfu"}


def test_cpu_smoke_run_writes_every_record(tmp_path):
    out = tmp_path / "cpu.json"
    # two of the four models (the static one and the one whose order changes); the GPU runs take all four
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--steps", "8", "--warmup", "1",
                           "--models", "gpt2", "--models", "gpt2-skip",
                           "--out", str(out), "--timeout", "900"], capture_output=True, text=True, timeout=1000)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    records = json.loads(out.read_text())
    assert {(r["model"], r["variant"]) for r in records if r["offload"] == "param"} == {
        (m, v) for m in ("gpt2", "gpt2-skip")
        for v in ("stock", "stock-persist0", "stock-noprefetch", "z3guard", "z3guard-nofast")}
    assert {r["offload"] for r in records} == {"none", "param", "param+optimizer"}
    for r in records:
        assert FIELDS <= set(r) and r["steps"] == 8 and r["median_step_s"] > 0
        assert r["model_flops_per_token"] > 0 and r["mfu"] is None  # no GPU peak to divide by on CPU
    by = {(r["model"], r["variant"], r["offload"]): r for r in records}
    # The block-skipping model: stock re-records on every other step, z3guard switches traces.
    assert by["gpt2-skip", "stock", "param"]["invalidations"] >= 4  # of 8 timed steps + 1 warm-up
    assert by["gpt2-skip", "z3guard", "param"]["invalidations"] <= 2
    assert by["gpt2-skip", "z3guard", "param"]["trace_switches"] >= 6
    assert by["gpt2", "z3guard", "param"]["invalidations"] == by["gpt2", "stock", "param"]["invalidations"] == 0
    assert "ZeRO-3 step time" in done.stdout


def test_isolated_runs_each_get_a_process_group(tmp_path):
    """--isolate: each run in its own process group, so the peak host memory recorded is the run's own."""
    out = tmp_path / "cpu.json"
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--steps", "3", "--warmup", "1", "--isolate",
                           "--run", "gpt2:stock:param+optimizer", "--run", "gpt2:z3guard:param+optimizer",
                           "--out", str(out), "--timeout", "300"], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    records = json.loads(out.read_text())
    assert [(r["variant"], r["isolated"]) for r in records] == [("stock", True), ("z3guard", True)]
    for r in records:
        assert set(r["phase_median_s"]) == {"forward", "backward", "step"}
        assert r["host_peak_rss_bytes"] >= r["host_rss_bytes"] - 2**20  # peak of its own process
    assert "2 process group(s)" in done.stdout and "host peak GiB" in done.stdout


def test_baselines_name_their_precision_and_threads(tmp_path):
    """stock-tuned takes this rank's share of the cores and gives it back for the next run; FSDP2 runs on the
    same model and batches, offloading parameters, gradients and the step together (it has no `param` alone)."""
    from z3guard.adapter.hostthreads import usable_cpus

    out = tmp_path / "cpu.json"
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--steps", "2", "--warmup", "1",
                           "--run", "gpt2:stock-tuned:none", "--run", "gpt2:stock:none",
                           "--run", "gpt2:fsdp2:param+optimizer", "--run", "gpt2:fsdp2:param",
                           "--out", str(out), "--timeout", "300"], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "skipped gpt2:fsdp2:param: not applicable" in done.stdout and "dtype / thr" in done.stdout
    records = json.loads(out.read_text())
    by = {r["variant"]: r for r in records}
    assert [r["variant"] for r in records] == ["stock-tuned", "stock", "fsdp2"]
    for r in records:
        assert FIELDS <= set(r) and r["steps"] == 2 and r["median_step_s"] > 0 and r["precision"] == "bf16"
        assert set(r["phase_median_s"]) == {"forward", "backward", "step"}
    share = max(1, usable_cpus() // 2)  # 2 ranks
    assert (by["stock-tuned"]["threads"], by["stock-tuned"]["omp_threads"]) == (share, str(share))
    launched = os.environ.get("OMP_NUM_THREADS", "1")  # what the launch gives each rank (scenarios/launch.py)
    assert (by["stock"]["threads"], by["stock"]["omp_threads"]) == (int(launched), launched)  # given back
    assert by["fsdp2"]["fsdp2_offload"].startswith("parameters, gradients and optimizer step")
    assert by["fsdp2"]["fsdp2_units"] == 5 and by["fsdp2"]["invalidations"] is None  # 4 blocks and the root


def test_step_parts_count_every_timed_step(tmp_path):
    """bench/profile_step.py --timers-only: each phase's milliseconds per step over all the timed steps
    (with --alternate the steps split in two columns; without it, none are left out or halved)."""
    import statistics

    out = tmp_path / "parts.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           str(BENCH.parent / "profile_step.py"), "--offload", "none", "--device", "cpu",
                           "--timers-only", "--warmup", "1", "--steps", "4", "--variants", "z3guard",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (record,) = json.loads(out.read_text())
    for phase in ("forward", "backward", "step", "optimizer.step"):
        samples = record["phases_s"][phase]
        assert len(samples) == 4
        assert abs(record["phases_ms"][phase] - 1e3 * statistics.median(samples)) < 1e-9


def test_model_flops_per_token_are_six_per_parameter_plus_attention(monkeypatch):
    """The Llama-shaped model of the GPU tables: 1.34B parameters, 24 layers of width 2048, 1024 tokens."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_models", BENCH.parent / "models.py")
    models = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, models)  # its dataclasses look their module up there
    spec.loader.exec_module(models)
    flops = models.flops_per_token("llama", "cuda")  # built on the meta device: no memory, no GPU
    parameters = (flops - 12 * 24 * 2048 * 1024) / 6
    assert 1.33e9 < parameters < 1.35e9 and parameters == int(parameters)
    assert models.flops_per_token("clip", "cuda") is None
