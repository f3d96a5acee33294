"""What a run that stopped early reports: the step, the exception, its traceback (the user's frames first),
and whether it is the ZeRO-3 trace failure a scenario studies or something else, about which no
conclusion may be drawn."""
from __future__ import annotations

import re
import sysconfig
import traceback
from dataclasses import dataclass, field
from pathlib import Path

# What ZeRO-3's parameter coordinator raises when a step's module or parameter order leaves the recorded
# trace, what ranks that gather different parameters run into, and what a parameter that the coordinator
# prefetched raises when other code partitions it (GatheredParameters inside a forward).
TRACE_FAILURES = ("tracing error", "still have inflight params", "pop from an empty deque",
                  "ZeroParamStatus", "ds_status", "data size doesn't match", "Cannot partition a param in flight")

_LIBRARY_ROOTS = tuple({str(Path(p).resolve()) for p in (sysconfig.get_paths()["stdlib"],
                                                         sysconfig.get_paths()["purelib"],
                                                         sysconfig.get_paths()["platlib"],
                                                         Path(__file__).resolve().parents[1])})


def is_trace_failure(exc: BaseException) -> bool:
    return any(text in str(exc) for text in TRACE_FAILURES)


def user_frames(exc: BaseException) -> list[str]:
    """"file:line in function" for the frames outside Python, its installed packages and z3guard: the
    frames of the user's own model, batch and loss, innermost last."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if not f.filename.startswith("<")
            and not str(Path(f.filename).resolve()).startswith(_LIBRARY_ROOTS)]
    return [f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in ours]


@dataclass
class Crash:
    step: int  # 0: while the model, the engine or the checkpoint were set up
    message: str
    module: str | None
    params: list[str]
    summary: str
    exception: str = "RuntimeError"
    related: bool = True  # the trace failure under study; False: anything else (no conclusion from the run)
    user_frames: list[str] = field(default_factory=list)
    traceback: str = ""

    @classmethod
    def parse(cls, step: int, exc: BaseException, module_paths: dict[int, str] | None = None) -> "Crash":
        text = str(exc)
        mod = re.search(r"module id: (\d+)", text)
        expected = text.split("but got")[0]
        names = sorted(set(re.findall(r"name=(\S+?) id=", expected)))
        got = sorted(set(re.findall(r"name=(\S+?) id=", text.split("but got")[-1])))
        count = re.search(r"expected the next (\d+) parameters", text)
        summary = (text.strip().splitlines() or [type(exc).__name__])[0]
        if count:
            summary += (f" expected the next {count.group(1)} parameters in the parameter fetch queue"
                        f" but got ({', '.join(got)})")
        module = (module_paths or {}).get(int(mod.group(1))) if mod else None
        return cls(step, text, module, names, summary, type(exc).__name__, is_trace_failure(exc),
                   user_frames(exc), "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
