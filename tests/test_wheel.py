"""z3guard installed as a regular wheel into a fresh environment (`make test-wheel` builds both and sets
Z3GUARD_WHEEL_PYTHON): the start-up hook is in site-packages, costs a process that never imports DeepSpeed
nothing, and `Z3GUARD=1` alone guards a Trainer job that never calls z3guard."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import z3guard
from z3guard.scenarios.launch import _free_port

PYTHON = os.environ.get("Z3GUARD_WHEEL_PYTHON")
pytestmark = pytest.mark.skipif(not PYTHON, reason="needs the wheel environment: make test-wheel")
SCRIPTS = Path(__file__).parent / "scripts"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("Z3GUARD") and k != "PYTHONPATH"}
    return {**env, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **extra}


def _python(code: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-c", code], env=_env(**extra), capture_output=True, text=True, timeout=timeout)


def test_the_start_up_hook_is_in_site_packages_not_an_editable_path():
    done = _python("import site, z3guard, z3guard_startup; print(site.getsitepackages()[0]); "
                   "print(z3guard.__file__); print(z3guard_startup.__file__)")
    assert done.returncode == 0, done.stderr
    site_packages, package, hook = done.stdout.split()
    assert (Path(site_packages) / "z3guard.pth").is_file()
    assert Path(package).is_relative_to(site_packages) and Path(hook).is_relative_to(site_packages)
    assert (Path(site_packages) / "z3guard" / "py.typed").is_file()


@pytest.mark.parametrize("switch", [None, "1"])
def test_a_process_that_never_imports_deepspeed_imports_nothing_of_z3guard_torch_or_deepspeed(switch):
    extra = {"Z3GUARD": switch} if switch else {}
    done = subprocess.run([PYTHON, "-X", "importtime", "-c", "pass"], env=_env(**extra), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    heavy = {m for m in imported if m.split(".")[0] in ("z3guard", "torch", "deepspeed", "numpy")}
    assert heavy == set(), heavy
    assert ("z3guard_startup" in imported) == bool(switch)  # the hook itself: standard library only


def test_z3guard_1_installs_when_deepspeed_is_imported_with_the_options_of_the_environment():
    code = "import deepspeed, z3guard; print(z3guard._state['installed'], z3guard._state['options'].fast_paths)"
    assert _python(code).stdout.split()[-2:] == ["False", "True"]
    assert _python(code, Z3GUARD="1").stdout.split()[-2:] == ["True", "True"]
    assert _python(code, Z3GUARD="1", Z3GUARD_OPTIONS="fast_paths=off").stdout.split()[-2:] == ["True", "False"]
    assert _python(code, Z3GUARD="0").stdout.split()[-2:] == ["False", "True"]
    # transformers asks `importlib.util.find_spec("deepspeed")` long before it imports DeepSpeed
    checked_first = "import importlib.util; importlib.util.find_spec('deepspeed'); " + code
    assert _python(checked_first, Z3GUARD="1").stdout.split()[-2:] == ["True", "True"]


def test_a_bad_option_in_the_environment_warns_and_leaves_the_job_alone_unless_strict():
    code = "import deepspeed, z3guard; print('installed', z3guard._state['installed'])"
    done = _python(code, Z3GUARD="1", Z3GUARD_OPTIONS="fast_path=off")
    assert done.returncode == 0 and "installed False" in done.stdout
    assert "unknown option 'fast_path'" in done.stderr and "fast_paths" in done.stderr  # names what is allowed
    strict = _python(code, Z3GUARD="1", Z3GUARD_OPTIONS="strict=on,host_threads=many")
    assert strict.returncode != 0 and "host_threads='many'" in strict.stderr


def _trainer(out: Path, phase: str, launcher: str = "torchrun", **extra: str) -> dict:
    script = [str(SCRIPTS / "hf_trainer_resume.py"), str(out), "--phase", phase]
    if launcher == "torchrun":
        cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *script]
    elif launcher == "accelerate":  # `accelerate launch --config_file` with a DeepSpeed ZeRO-3 config file
        cmd = [PYTHON, "-m", "accelerate.commands.launch", "--config_file", str(_accelerate_config(out.parent)),
               *script, "--config-from-launcher"]
    else:  # DeepSpeed's own launcher, as `deepspeed --num_gpus 2 script.py` starts it
        cmd = [PYTHON, "-m", "deepspeed.launcher.runner", "--num_gpus=2", "--no_local_rank",
               f"--master_port={_free_port()}", *script]
    log_path = out.parent / f"{out.name}-{phase}.log"
    with log_path.open("w") as log:
        done = subprocess.run(cmd, env=_env(LOCAL_SIZE="2", **extra), stdout=log, stderr=subprocess.STDOUT,
                              timeout=420, start_new_session=True)
    assert done.returncode == 0, log_path.read_text()[-5000:]
    return json.loads((out / f"{phase}.json").read_text())


def _accelerate_config(folder: Path) -> Path:
    """accelerate's config for 2 CPU processes with DeepSpeed, naming a ZeRO-3 config file (HF's example:
    CPU offload, "auto" sizes for Trainer to fill)."""
    from z3guard.scenarios.config import resolve_auto

    ds = resolve_auto(hidden_size=512, dtype="bf16", micro_batch=4, world_size=2)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        ds[key] = "auto"
    ds["fp16"]["enabled"] = ds["bf16"]["enabled"] = "auto"
    (folder / "ds_zero3.json").write_text(json.dumps(ds))
    config = folder / "accelerate.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                      f"  deepspeed_config_file: {folder / 'ds_zero3.json'}\n  zero3_init_flag: false\n"
                      "num_processes: 2\nnum_machines: 1\nmachine_rank: 0\nuse_cpu: true\n")
    return config


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    return _trainer(tmp_path_factory.mktemp("trainer") / "straight", "straight")


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> Path:
    """The job's first part under Z3GUARD=1 (torchrun): saved at step 4, then stopped."""
    out = tmp_path_factory.mktemp("trainer") / "guarded"
    _trainer(out, "first", Z3GUARD="1")
    return out


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed", "accelerate"])
def test_z3guard_1_alone_guards_a_trainer_resume_that_never_calls_z3guard(tmp_path, straight, interrupted, launcher):
    """Stock (no variable) crashes after resume + skipped step; with Z3GUARD=1 the resumed losses are the
    uninterrupted run's, and rank 0 logged the banner once. Each launcher resumes the same saved job."""
    shutil.copytree(interrupted, tmp_path / "guarded")
    guarded = _trainer(tmp_path / "guarded", "resume", launcher, Z3GUARD="1")
    if launcher == "torchrun":  # stock's crash does not depend on the launcher (tests/test_repro.py)
        for phase in ("first", "resume"):
            stock = _trainer(tmp_path / "stock", phase, launcher)
    if launcher == "torchrun":
        assert stock["crash"] and "expected the next 4 parameters" in stock["crash"]
        assert "guards this ZeRO-3 engine" not in (tmp_path / "stock-resume.log").read_text()
    assert guarded["crash"] is None
    resumed = [s for s in guarded["losses"] if int(s) > 4]
    assert resumed == ["5", "6", "7", "8"]
    assert {s: guarded["losses"][s] for s in resumed} == {s: straight["losses"][s] for s in resumed}
    banner = f"z3guard {z3guard.__version__} guards this ZeRO-3 engine (DeepSpeed "
    assert (tmp_path / "guarded-resume.log").read_text().count(banner) == 1  # rank 0, once


def _aborted_at_exit(log: str, last_line: str) -> bool:
    """A rank of a script that never calls destroy_process_group can abort in interpreter shutdown, after
    everything is written, while gloo's worker threads still hold finished work (pytorch/pytorch#190489;
    stock runs alike). True when that abort came after the script's last line of output."""
    abort = log.rfind("terminate called without an active exception")
    return abort > log.rfind(last_line) >= 0


def _trl_sft(folder: Path, out: str, *extra: str, **env: str) -> dict[int, float]:
    """TRL's own CLI (`trl sft`, which starts itself through `accelerate launch`) on the tiny Llama, offline:
    8 steps, a checkpoint every 4. Returns the losses of the checkpoint at step 8."""
    cmd = [str(Path(PYTHON).parent / "trl"), "sft", "--accelerate_config", str(folder / "accelerate.yaml"),
           "--model_name_or_path", str(folder / "model"), "--dataset_name", str(folder / "data"),
           "--output_dir", str(folder / out), "--max_steps", "8", "--save_steps", "4", "--logging_steps", "1",
           "--per_device_train_batch_size", "4", "--max_length", "64", "--learning_rate", "1e-3",
           "--lr_scheduler_type", "constant", "--bf16", "true", "--use_cpu", "true", "--seed", "1234",
           "--save_only_model", "false", "--report_to", "none", "--disable_tqdm", "true", *extra]
    log_path = folder / f"{out}.log"
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(folder / "hf"), "LOCAL_SIZE": "2"}
    with log_path.open("w") as log:
        done = subprocess.run(cmd, env=_env(**offline, **env), stdout=log, stderr=subprocess.STDOUT, timeout=420,
                              start_new_session=True, cwd=folder)
    log_text = log_path.read_text()
    assert done.returncode == 0 or _aborted_at_exit(log_text, "Model saved to"), log_text[-5000:]
    history = json.loads((folder / out / "checkpoint-8" / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


@pytest.mark.skipif(not PYTHON or not (Path(PYTHON).parent / "trl").exists(), reason="needs TRL in the wheel env")
def test_trl_sft_under_z3guard_1_saves_resumes_and_equals_stock(tmp_path):
    """A training CLI we do not own, with nothing but the environment changed: the banner is in its log, its
    checkpoints carry z3guard's manifest, and its losses and saved weights are stock's, resumed or not."""
    made = subprocess.run([PYTHON, str(SCRIPTS / "tiny_llama.py"), str(tmp_path)], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    _accelerate_config(tmp_path)
    stock = _trl_sft(tmp_path, "stock")
    guarded = _trl_sft(tmp_path, "guarded", Z3GUARD="1")
    resumed = _trl_sft(tmp_path, "resumed", "--resume_from_checkpoint", str(tmp_path / "guarded" / "checkpoint-4"),
                       Z3GUARD="1")
    assert sorted(stock) == list(range(1, 9))
    assert guarded == stock and resumed == stock
    weights = [(tmp_path / run / "checkpoint-8" / "model.safetensors").read_bytes()
               for run in ("stock", "guarded", "resumed")]
    assert weights[0] == weights[1] == weights[2]
    banner = f"z3guard {z3guard.__version__} guards this ZeRO-3 engine (DeepSpeed "
    assert (tmp_path / "stock.log").read_text().count(banner) == 0
    for run, saved in (("guarded", (4, 8)), ("resumed", (8,))):
        assert (tmp_path / f"{run}.log").read_text().count(banner) == 1
        for step in saved:
            assert (tmp_path / run / f"checkpoint-{step}" / f"global_step{step}" / "z3guard-manifest.json").is_file()
    assert not (tmp_path / "stock" / "checkpoint-4" / "global_step4" / "z3guard-manifest.json").exists()
