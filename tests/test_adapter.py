"""The version gate and the public verbs, in-process (no process group needed)."""
from __future__ import annotations

import pytest

import z3guard
from z3guard import adapter


@pytest.mark.parametrize("release", ["0.9.0", "0.9.2", "0.10.0", "0.14.3", "0.14.5", "0.15.0", "0.18.9", "0.19.7",
                                     "0.19.9", "0.20.0"])
def test_unsupported_release_is_refused_by_name(release):
    with pytest.raises(adapter.UnsupportedDeepSpeed) as err:
        adapter.adapter_for(release)
    msg = str(err.value)
    assert f"DeepSpeed {release}" in msg
    assert "tested and supported releases: 0.9.1, 0.14.4, 0.19.8" in msg
    assert "Nothing was patched" in msg


@pytest.mark.parametrize("release,module",
                         [("0.9.1", "v0_9"), ("0.14.4", "v0_14"), ("0.19.8", "v0_19"), ("0.19.8+6bd4b5d", "v0_19")])
def test_supported_releases_pick_their_adapter(release, module):
    assert adapter.adapter_for(release) == module


def test_install_is_idempotent_and_uninstall_restores_deepspeed():
    import deepspeed
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload, ZeROOrderedDict

    def patchable():
        return deepspeed.initialize, ZeROOrderedDict.__getitem__, DeepSpeedZeRoOffload.__init__

    original = patchable()
    z3guard.install()
    patched = patchable()
    assert all(p is not o for p, o in zip(patched, original))
    z3guard.install()
    assert patchable() == patched
    z3guard.uninstall()
    assert patchable() == original
    z3guard.uninstall()  # a no-op when nothing is installed


def test_an_unsupported_release_patches_nothing(monkeypatch):
    import deepspeed

    adapter.load.cache_clear()
    monkeypatch.setattr(deepspeed, "__version__", "0.18.0")
    original = deepspeed.initialize
    try:
        with pytest.raises(adapter.UnsupportedDeepSpeed):
            z3guard.install()
        assert deepspeed.initialize is original
    finally:
        adapter.load.cache_clear()


@pytest.mark.parametrize("field,value,expected", [
    ("fast_writeback", "no", "expected True or False, got 'no'"),
    ("warn", 0, "expected True or False, got 0"),
    ("host_threads", "8", "expected None (auto), 0 (off) or a positive number of threads, got '8'"),
    ("host_threads", -3, "got -3"),
    ("host_threads", True, "got True"),
])
def test_bad_options_are_refused_by_name(field, value, expected):
    """Before the check, "no" turned a fast path on, -3 turned host threads off silently, and "8" failed
    inside the engine's start."""
    with pytest.raises(ValueError) as refused:
        z3guard.GuardOptions(**{field: value})
    assert str(refused.value).startswith(f"GuardOptions.{field}: ") and expected in str(refused.value)
    assert [z3guard.GuardOptions(host_threads=n).host_threads for n in (8, 0, None)] == [8, 0, None]
