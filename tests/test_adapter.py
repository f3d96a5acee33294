"""How z3guard judges the installed DeepSpeed (by its code, never its version string), and the public verbs,
in-process (no process group needed). Runs on every release of the CPU matrix."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from packaging.version import Version
import torch
from torch import nn

import deepspeed
import z3guard
from z3guard import adapter
from z3guard.adapter import contract, fingerprint, leanhooks, lifecycle, releases, speedpaths


@pytest.fixture(autouse=True)
def fresh_state():
    """Every test starts and ends with nothing installed and nothing cached about the installed code."""
    def clear():
        z3guard.uninstall()
        leanhooks.remove()  # process-wide; a test below applies the speed paths without installing
        adapter.load.cache_clear()
        speedpaths.current.cache_clear()
        speedpaths.say_off.cache_clear()
        z3guard._warn_once.cache_clear()
        fingerprint._module_tree.cache_clear()

    clear()
    yield
    clear()


def _patchable():
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload, ZeROOrderedDict

    return (deepspeed.initialize, ZeROOrderedDict.__getitem__, DeepSpeedZeRoOffload.__init__,
            deepspeed.zero.GatheredParameters.__enter__)


def test_the_installed_release_passes_the_self_check():
    assert contract.problems() == []


def test_the_lifecycle_is_read_from_the_code_and_matches_the_release_history():
    """What each release's code says, against what its history says (the ranges in lifecycle.py)."""
    v = Version(Version(deepspeed.__version__).base_version)
    assert lifecycle.detect() == lifecycle.Lifecycle(
        coordinator_per_mode=v < Version("0.15.4"), invalidation_drains_inflight=v >= Version("0.15.3"),
        fetch_takes_forward=v >= Version("0.10"), registry_on_module=v >= Version("0.10"))


def test_the_speed_paths_on_here_are_the_ones_the_compatibility_table_lists():
    """The table (releases.py, the README) and the fingerprints cannot disagree on a tested release."""
    release = deepspeed.__version__
    if releases.tested(release) is None:
        pytest.skip(f"DeepSpeed {release} is not in the tested list")
    on_here = [p.name for p in speedpaths.PATHS if speedpaths.why_off(p.name) is None]
    assert on_here == releases.speed_paths_on(release)


def test_the_readme_carries_the_generated_compatibility_table():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert releases.markdown() in readme, "regenerate it: python -m z3guard.adapter.releases"


def test_install_is_idempotent_and_uninstall_restores_deepspeed():
    original = _patchable()
    assert z3guard.install() is True
    patched = _patchable()
    assert all(p is not o for p, o in zip(patched, original))
    z3guard.install()
    assert _patchable() == patched
    z3guard.uninstall()
    assert _patchable() == original
    z3guard.uninstall()  # a no-op when nothing is installed


def _break_the_coordinator(monkeypatch):
    """A DeepSpeed whose coordinator lost a method the crash fix wraps (what a future release might do)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    monkeypatch.delattr(PartitionedParameterCoordinator, "trace_prologue")


def test_a_deepspeed_failing_the_self_check_is_left_alone_with_one_warning(monkeypatch, caplog):
    _break_the_coordinator(monkeypatch)
    original = _patchable()
    with caplog.at_level(logging.WARNING, logger="z3guard"):
        assert z3guard.install() is False
        assert z3guard.install() is False
    assert _patchable() == original  # nothing patched, not half of it
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "not guarding this job" in warnings[0] and "lacks trace_prologue" in warnings[0]
    assert "Nothing was patched" in warnings[0]


def test_strict_raises_where_the_self_check_fails(monkeypatch):
    _break_the_coordinator(monkeypatch)
    original = _patchable()
    with pytest.raises(adapter.IncompatibleDeepSpeed, match="lacks trace_prologue"):
        z3guard.install(z3guard.GuardOptions(strict=True))
    assert _patchable() == original


@pytest.mark.parametrize("suffix", ["+6bd4b5d", ".post1"])
def test_a_local_build_is_judged_by_its_code_with_one_warning(monkeypatch, caplog, suffix):
    """0.19.8+abc is not 0.19.8 by name: it passes or fails the same self-check, and says it is untested."""
    release = Version(deepspeed.__version__).base_version + suffix
    monkeypatch.setattr(deepspeed, "__version__", release)
    with caplog.at_level(logging.WARNING, logger="z3guard"):
        assert z3guard.install() is True
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"DeepSpeed {release} is not among the releases z3guard was tested on" in warnings[0]
    assert hasattr(deepspeed.initialize, "__wrapped__")  # installed


def test_a_speed_path_whose_stock_code_differs_stays_off_alone(monkeypatch, caplog):
    """One path's stock code no longer matches what it was verified on: that path alone is off, once said."""
    verified_here = [p.name for p in speedpaths.PATHS if speedpaths.why_off(p.name) is None]
    if "writeback" not in verified_here:
        pytest.skip("no speed path is verified on this release")
    monkeypatch.setitem(speedpaths.VERIFIED, "writeback", {"0000000000000000": ("a release",)})
    passed = {}

    def apply(engine, writeback, overflow_check, threads, persistent_gather, fused_step, grad_offload,
              grads_on_host, grad_bucket, grad_norm, grad_batch):
        passed.update(writeback=writeback, overflow_check=overflow_check, persistent_gather=persistent_gather,
                      fused_step=fused_step, grad_offload=grad_offload, grads_on_host=grads_on_host,
                      grad_bucket=grad_bucket, grad_norm=grad_norm, grad_batch=grad_batch)
        return []

    from z3guard.adapter import fastpaths

    monkeypatch.setattr(fastpaths, "apply", apply)
    engine = SimpleNamespace(module=nn.Linear(2, 2), optimizer=SimpleNamespace(parameter_offload=object()))
    with caplog.at_level(logging.INFO, logger="z3guard"):
        for _ in range(2):
            adapter.load().apply_fast_paths(engine, z3guard.GuardOptions())
    assert passed == dict(writeback=False, overflow_check=True, persistent_gather=True, fused_step=True,
                          grad_offload=True, grads_on_host=True, grad_bucket=True, grad_norm=True,
                          grad_batch=speedpaths.why_off("grad_batch") is None)  # verified on fewer releases
    said = [r.getMessage() for r in caplog.records if "speed path" in r.getMessage()]
    assert len(said) == 1 and "speed path writeback off" in said[0] and "differs" in said[0]


def test_fingerprints_ignore_comments_docstrings_and_layout_but_not_code():
    base = 'def f(x):\n    """Doc."""\n    return (x + 1)  # one\n'
    same = 'def f(x):\n    # a comment\n\n    return (x\n            + 1)\n'
    other = "def f(x):\n    return x + 2\n"
    fstring = 'def f(x):\n    return f"{x!r:>4}"\n'
    assert fingerprint.normalise(base) == fingerprint.normalise(same)
    assert fingerprint.normalise(base) != fingerprint.normalise(other)
    assert "STRING f\"{x!r:>4}\"" in fingerprint.normalise(fstring)  # one token on every Python


def test_fingerprints_read_the_code_as_written_not_its_decorators():
    """`fetch_sub_module` is wrapped by DeepSpeed's `instrument_w_nvtx` (no functools.wraps)."""
    node, text = fingerprint.definition(speedpaths.PPC + "fetch_sub_module")
    assert node.name == "fetch_sub_module" and "def fetch_sub_module(self, current_submodule" in text
    assert fingerprint.parameters(speedpaths.PPC + "fetch_sub_module")[:2] == ["self", "current_submodule"]


@pytest.mark.parametrize("field,value,expected", [
    ("fast_writeback", "no", "expected True or False, got 'no'"),
    ("warn", 0, "expected True or False, got 0"),
    ("strict", "yes", "expected True or False, got 'yes'"),
    ("host_threads", "8", "expected None (auto), 0 (off) or a positive number of threads, got '8'"),
    ("host_threads", -3, "got -3"),
    ("host_threads", True, "got True"),
    ("lockstep_timeout", 0, "expected a positive number of seconds, got 0"),
    ("lockstep_timeout", "30", "got '30'"),
])
def test_bad_options_are_refused_by_name(field, value, expected):
    """Before the check, "no" turned a fast path on, -3 turned host threads off silently, and "8" failed
    inside the engine's start."""
    with pytest.raises(ValueError) as refused:
        z3guard.GuardOptions(**{field: value})
    assert str(refused.value).startswith(f"GuardOptions.{field}: ") and expected in str(refused.value)
    assert [z3guard.GuardOptions(host_threads=n).host_threads for n in (8, 0, None)] == [8, 0, None]


def test_options_from_the_environment():
    from z3guard.options import from_environment

    assert from_environment("") == z3guard.GuardOptions()
    got = from_environment(" fast_paths=off , host_threads=8,strict=YES,fast_block_fetch=0")
    assert got == z3guard.GuardOptions(fast_paths=False, host_threads=8, strict=True, fast_block_fetch=False)
    assert from_environment("host_threads=auto").host_threads is None
    assert from_environment("host_threads=off").host_threads == 0
    assert from_environment("lockstep_timeout=30").lockstep_timeout == 30.0


@pytest.mark.parametrize("text, expected", [
    ("fast_path=off", "unknown option 'fast_path'; options: warn, fast_paths,"),
    ("fast_paths=maybe", "fast_paths='maybe'; expected one of 1, on, true, yes, 0, off, false, no"),
    ("host_threads=many", "host_threads='many'; expected auto, off or a number of threads"),
    ("strict", "'strict' has no value; write strict=<value>"),
    ("lockstep_timeout=soon", "lockstep_timeout='soon'; expected a number of seconds"),
])
def test_bad_options_in_the_environment_are_refused_by_name(text, expected):
    from z3guard.options import from_environment

    with pytest.raises(ValueError) as refused:
        from_environment(text)
    assert str(refused.value).startswith("Z3GUARD_OPTIONS: ") and expected in str(refused.value)


def test_z3guard_env_names_every_field_as_json():
    import json
    import subprocess
    import sys

    from pydantic import VERSION

    if VERSION.startswith("1."):  # DeepSpeed 0.10 pins pydantic 1; typer, the CLI's parser, needs 2
        pytest.skip("the z3guard command needs pydantic 2 (through typer); the library does not")
    done = subprocess.run([sys.executable, "-m", "z3guard.cli", "env", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert set(data["versions"]) == {"z3guard", "deepspeed", "torch", "transformers", "accelerate"}
    ds = data["deepspeed"]
    assert ds["release"] == deepspeed.__version__ and ds["self_check"] == "passed" and ds["crash_fix"] == "on"
    assert ds["tested"] == (releases.tested(deepspeed.__version__) is not None)
    assert set(ds["speed_paths"]) == {p.name for p in speedpaths.PATHS}
    assert set(data["startup_hook"]) == {"installed", "Z3GUARD", "enabled", "Z3GUARD_OPTIONS", "options"}


def test_module_params_is_what_zero3_fetches_for_a_module_and_a_leaf_block():
    """The divergence check's parameter set, read from the modules' dicts, against DeepSpeed's own
    `iter_params` (recursive for a leaf module), with a submodule shared twice and a parameter unset."""
    from deepspeed.runtime.zero.partition_parameters import _init_external_params
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    shared = nn.Linear(2, 2)
    block = nn.Sequential(nn.Linear(2, 3), nn.Sequential(shared, nn.ReLU(), shared), nn.LayerNorm(3))
    block.register_parameter("unset", None)
    block.register_parameter("own", nn.Parameter(torch.ones(1)))
    for m in block.modules():
        _init_external_params(m)  # as ZeRO-3 does for every module
    outside = nn.Parameter(torch.ones(1))
    block._external_params[id(outside)] = outside  # what register_external_parameter(block, ...) adds
    fetched = adapter.load().module_params
    for module in (block, shared):
        assert fetched(module).keys() == {id(p) for p in iter_params(module, recurse=False)}
    set_z3_leaf_module = getattr(deepspeed.utils, "set_z3_leaf_module", None)
    if set_z3_leaf_module is None:
        return  # before 0.13: no leaf modules
    set_z3_leaf_module(block, True)
    assert fetched(block).keys() == {id(p) for p in iter_params(block, recurse=True)}
    assert len(fetched(block)) == 8  # own, outside, 2 + 2 (shared, once), 2 + 2 (the norm's)
