"""Prometheus text exposition (format 0.0.4) without prometheus_client: counters, gauges and histograms with
labels, each rendered with its HELP and TYPE lines."""

from __future__ import annotations

import bisect
import math
import threading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.labels = name, help, labels
        self._values: dict[tuple[str, ...], object] = {}
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, object]) -> tuple[str, ...]:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name}: labels must be {self.labels}, got {tuple(labels)}")
        return tuple(str(labels[k]) for k in self.labels)

    def _set(self, value: float, labels: dict[str, object]) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def _series(self, key: tuple[str, ...], extra: str = "") -> str:
        pairs = [f'{k}="{_escape(v)}"' for k, v in zip(self.labels, key, strict=True)]
        pairs += [extra] if extra else []
        return "{" + ",".join(pairs) + "}" if pairs else ""

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        with self._lock:
            for key, value in sorted(self._values.items()):
                lines += self._samples(key, value)
        return lines

    def _samples(self, key: tuple[str, ...], value: object) -> list[str]:
        return [f"{self.name}{self._series(key)} {_num(value)}"]


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up, got {amount}")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def set_total(self, total: float, **labels: object) -> None:
        """The count kept elsewhere (it must only go up there)."""
        self._set(total, labels)


class Gauge(_Metric):
    kind = "gauge"

    def set(self, value: float, **labels: object) -> None:
        self._set(value, labels)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...],
                 labels: tuple[str, ...] = ()) -> None:
        super().__init__(name, help, labels)
        self.buckets = tuple(sorted(buckets))

    def observe(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            counts, total = self._values.get(key, ([0] * (len(self.buckets) + 1), 0.0))
            counts[bisect.bisect_left(self.buckets, value)] += 1
            self._values[key] = (counts, total + value)

    def _samples(self, key: tuple[str, ...], value: object) -> list[str]:
        counts, total = value
        lines, running = [], 0
        for bound, count in zip([*self.buckets, math.inf], counts, strict=True):
            running += count
            le = f'le="{_num(bound)}"'
            lines.append(f"{self.name}_bucket{self._series(key, le)} {running}")
        return lines + [f"{self.name}_sum{self._series(key)} {_num(total)}",
                        f"{self.name}_count{self._series(key)} {running}"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: object) -> str:
    v = float(value)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if v.is_integer() else repr(v)
