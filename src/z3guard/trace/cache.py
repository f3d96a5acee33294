"""Recorded ZeRO-3 traces, more than one: a step that departs from the trace it follows continues
on a recorded trace that agrees with what has run so far, instead of giving prefetch up.

Where none agrees with the whole step so far (routing: each layer picks its expert from the data, so
the step's order is a combination no earlier step ran), the step continues on a trace that ran the
same module at the same position: what follows in it (the next layer's attention, say) is still the
best guess, and a wrong guess costs one released prefetch, not a result."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Trace:
    modules: tuple  # the module order of one forward+backward
    params: tuple  # DeepSpeed's parameter trace for that order (opaque here)

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(id(m) for m in self.modules)


class TraceCache:
    """At most `capacity` traces, least recently used evicted first."""

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self._traces: OrderedDict[tuple[int, ...], Trace] = OrderedDict()
        self.switches = 0  # departures served from the cache
        self.resyncs = 0  # of which served by a trace that agreed at the position only
        self.recordings = 0  # traces recorded (each one a step without prefetch past its divergence)

    def __len__(self) -> int:
        return len(self._traces)

    def add(self, trace: Trace) -> None:
        self._traces[trace.key] = trace
        self._traces.move_to_end(trace.key)
        while len(self._traces) > self.capacity:
            self._traces.popitem(last=False)
        self.recordings += 1

    def traces(self) -> list[Trace]:
        return list(self._traces.values())

    def clear(self) -> None:
        self._traces.clear()

    def agreeing(self, ran: Sequence[Any], now: Any) -> Trace | None:
        """The most recently used trace whose order starts with `ran` followed by `now`; else the most
        recently used one that has `now` at this position."""
        n = len(ran)
        ran_ids = tuple(id(m) for m in ran)
        at_position = [k for k in reversed(self._traces) if len(k) > n and k[n] == id(now)]
        key = next((k for k in at_position if k[:n] == ran_ids), None)
        if key is None and at_position:
            key = at_position[0]
            self.resyncs += 1
        if key is None:
            return None
        self._traces.move_to_end(key)
        self.switches += 1
        return self._traces[key]
