"""Recorded ZeRO-3 traces, more than one: a step that departs from the trace it follows continues
on a recorded trace that agrees with what has run so far, instead of giving prefetch up."""
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
        """The most recently used trace whose order starts with `ran` followed by `now`."""
        n = len(ran)
        ran_ids = tuple(id(m) for m in ran)
        for key in reversed(self._traces):
            if len(key) > n and key[n] == id(now) and key[:n] == ran_ids:
                trace = self._traces[key]
                self._traces.move_to_end(key)
                self.switches += 1
                return trace
        return None
