"""The start-up hook behind `Z3GUARD=1`, for training jobs whose code you do not own.

`pip install z3guard` puts `z3guard.pth` in site-packages; Python runs its one line at every start. That
line imports this module only when `Z3GUARD` is set (and not 0), and this module imports nothing but the
standard library: it waits, as an import hook, for the process to import `deepspeed`, and installs z3guard
right after. Launchers, data-loader and tokenizer workers, anything that never imports DeepSpeed pays for
one small module and sees nothing else. Options come from `Z3GUARD_OPTIONS` (see z3guard.options).
"""
from __future__ import annotations

import os
import sys

ENABLED = os.environ.get("Z3GUARD", "").strip().lower() not in ("", "0", "off", "false", "no")


class _AfterDeepSpeed:
    """A meta path finder (by its `find_spec`: `importlib.abc` alone would cost a start-up 40 ms) that finds
    nothing itself: asks the finders after it for `deepspeed` and wraps the loader they return,
    so that z3guard installs once DeepSpeed has finished loading. Availability checks
    (`importlib.util.find_spec("deepspeed")`, as transformers makes) load nothing and change nothing:
    the hook steps out of the import system only when DeepSpeed is really imported."""

    def __init__(self) -> None:
        self._asking = False

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed" or self._asking:
            return None
        self._asking = True
        try:
            spec = next(filter(None, (getattr(f, "find_spec", lambda *a: None)(name, path, target)
                                      for f in list(sys.meta_path) if f is not self)), None)
        finally:
            self._asking = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module
        hook = self

        def exec_module(module):
            if hook in sys.meta_path:
                sys.meta_path.remove(hook)
            load(module)
            _install()

        spec.loader.exec_module = exec_module
        return spec


def _install() -> None:
    """Never breaks the job: a bad option or an unexpected DeepSpeed is one warning, unless strict."""
    import logging

    options_text = os.environ.get("Z3GUARD_OPTIONS", "")
    try:
        import z3guard
        from z3guard.options import from_environment

        options = from_environment(options_text)
    except Exception as exc:
        if "strict=1" in options_text.replace(" ", "") or "strict=on" in options_text.replace(" ", ""):
            raise
        logging.getLogger("z3guard").warning("z3guard: not guarding this job (Z3GUARD=1): %s", exc)
        return
    z3guard.install(options)


if ENABLED and not any(isinstance(f, _AfterDeepSpeed) for f in sys.meta_path):
    if "deepspeed" in sys.modules:
        _install()
    else:
        sys.meta_path.insert(0, _AfterDeepSpeed())
