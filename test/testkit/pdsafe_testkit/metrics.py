"""The one reader of a server's Prometheus ``/metrics`` (tests, benchmark, harness).

``parse_metrics`` turns the text exposition format into ``Sample`` s; ``metric_total`` sums
one metric over its label sets, optionally only the samples whose labels match. Sample names
are matched exactly as exposed: a counter declared as ``sglang:pdsafe_x`` is exposed as
``sglang:pdsafe_x_total`` (plus ``..._created``, which is never summed by accident because
names must match exactly).

Invariant: a metric absent from the scrape totals 0.0 (a counter that was never incremented is
not exported by every server build), and a malformed line raises instead of being skipped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import requests

__all__ = ["Sample", "metric_total", "parse_metrics", "scrape", "sum_samples"]

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"(?:\{(?P<labels>.*)\})?"
    r"\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$"
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True)
class Sample:
    """One exposed sample: metric name, its labels and its value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def _unescape(v: str) -> str:
    return v.replace(r"\"", '"').replace(r"\n", "\n").replace("\\\\", "\\")


def _labels(text: str, line: str) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"malformed labels in /metrics line: {line!r}")
        out.append((m.group(1), _unescape(m.group(2))))
        pos = m.end()
    return tuple(out)


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition (comments and blank lines skipped)."""
    samples: list[Sample] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m is None:
            raise ValueError(f"malformed /metrics line: {line!r}")
        raw = m.group("value")
        value = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}.get(raw)
        samples.append(Sample(m.group("name"), _labels(m.group("labels") or "", line),
                              float(raw) if value is None else value))
    return samples


def scrape(url: str, timeout: float = 30.0) -> list[Sample]:
    """The samples ``url``/metrics exposes now (``url``: a server's base URL)."""
    r = requests.get(url.rstrip("/") + "/metrics", timeout=timeout)
    r.raise_for_status()
    return parse_metrics(r.text)


def sum_samples(samples: Iterable[Sample], names: str | Iterable[str], **labels: str) -> float:
    """Sum of the samples named ``names`` (one name or several) whose labels include
    ``labels``; 0.0 when there is none."""
    wanted = {names} if isinstance(names, str) else set(names)
    total = 0.0
    for s in samples:
        if s.name in wanted and all(s.label(k) == v for k, v in labels.items()):
            total += s.value
    return total


def metric_total(url: str, name: str, **labels: str) -> float:
    """Sum of the metric ``name`` on ``url``/metrics over its label sets (only those matching
    ``labels``, when given); 0.0 when absent."""
    return sum_samples(scrape(url), name, **labels)
