"""Prometheus text-format (0.0.4) metrics for the Draw and Discard service, per process:
counters, gauges and latency histograms whose labels never carry client data."""

from __future__ import annotations

import bisect
import collections

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _labels(labels: tuple) -> str:
  return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""


class Registry:
  """Metrics of one process.

  Args:
    prefix: name prefix of every metric.
  """

  def __init__(self, prefix: str = "ddml"):
    self.prefix = prefix
    self._counters: dict = collections.defaultdict(float)
    self._gauges: dict = {}
    self._help: dict = {}
    self._hist: dict = {}

  def inc(self, name: str, n: float = 1.0, help_text: str = "", **labels) -> None:
    """Adds n to counter `name` (without the prefix) with `labels`; help_text is the HELP line
    (kept from the first call)."""
    self._help.setdefault(name, help_text)
    key = (name, tuple(sorted(labels.items()))) if labels else (name, ())
    self._counters[key] += n

  def set(self, name: str, value: float, help_text: str = "", **labels) -> None:
    """Sets gauge `name` with `labels` to value (help_text: the HELP line)."""
    self._help.setdefault(name, help_text)
    self._gauges[(name, tuple(sorted(labels.items())))] = float(value)

  def observe(self, name: str, seconds: float, help_text: str = "", **labels) -> None:
    """Adds one observation in seconds to histogram `name` with `labels` (help_text: the HELP
    line)."""
    self._help.setdefault(name, help_text)
    key = (name, tuple(sorted(labels.items())))
    h = self._hist.get(key)
    if h is None:
      h = self._hist[key] = [[0] * len(_BUCKETS), 0.0, 0]
    i = bisect.bisect_left(_BUCKETS, seconds)
    if i < len(_BUCKETS):
      h[0][i] += 1
    h[1] += seconds
    h[2] += 1

  def counter(self, name: str, **labels) -> float:
    """The current value of counter `name` with `labels` (0 if never incremented)."""
    return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

  def render(self) -> str:
    """All metrics in the text exposition format, one '# HELP'/'# TYPE' header per name."""
    out = []
    for kind, table in (("counter", self._counters), ("gauge", self._gauges)):
      for name in sorted({n for n, _ in table}):
        full = f"{self.prefix}_{name}"
        out.append(f"# HELP {full} {self._help.get(name) or name}")
        out.append(f"# TYPE {full} {kind}")
        for (n, labels), v in sorted(table.items()):
          if n == name:
            out.append(f"{full}{_labels(labels)} {v:g}")
    for name in sorted({n for n, _ in self._hist}):
      full = f"{self.prefix}_{name}"
      out.append(f"# HELP {full} {self._help.get(name) or name}")
      out.append(f"# TYPE {full} histogram")
      for (n, labels), (counts, total, count) in sorted(self._hist.items()):
        if n != name:
          continue
        acc = 0
        for b, c in zip(_BUCKETS, counts):
          acc += c
          out.append(f"{full}_bucket{_labels(labels + (('le', f'{b:g}'),))} {acc}")
        out.append(f"{full}_bucket{_labels(labels + (('le', '+Inf'),))} {count}")
        out.append(f"{full}_sum{_labels(labels)} {total:g}")
        out.append(f"{full}_count{_labels(labels)} {count}")
    return "\n".join(out) + "\n"
