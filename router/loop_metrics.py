"""Counters and histograms for the router's hot path: updated on its event loop
only, so with no lock, and exposed through the same registry and text format
as prometheus_client's own (a counter's `_total`, a histogram's `_bucket`,
`_sum` and `_count`; no `_created` series).

prometheus_client takes a lock and runs several Python calls in every update
(a histogram also walks its buckets in Python). The router updates about ten
series a request, which came to a few percent of its CPU a request on the
OpenAI path (benchmarks/router/NOTES.md). Here an update is one or two
attribute additions and a bisect.

Scrapes run on the metrics server's thread. They copy each series in one C call
(list() of a dict or list), which the loop cannot interleave, so a scrape sees
every series whole; a histogram's sum may lag its buckets by the one update the
loop made between the two copies, as prometheus_client's own can.
"""

from __future__ import annotations

import math
from bisect import bisect_left

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class _Series:
    """One labelled series of a LoopCounter."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"a counter only goes up, not by {amount}")
        self.value += amount


class LoopCounter:
    """prometheus_client's Counter, as the router uses it: inc() when it has no
    labels, labels(*values).inc() when it has (keep the child: a lookup a call)."""

    def __init__(self, name: str, documentation: str, labelnames=(), registry=None):
        self.name = name[:-len("_total")] if name.endswith("_total") else name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.value = 0.0
        self._children: dict[tuple[str, ...], _Series] = {}
        if registry is not None:
            registry.register(self)

    def inc(self, amount: float = 1) -> None:
        if self.labelnames:
            raise ValueError(f"{self.name} has labels {self.labelnames}: use labels(...).inc()")
        if amount < 0:
            raise ValueError(f"a counter only goes up, not by {amount}")
        self.value += amount

    def labels(self, *values) -> _Series:
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, not {values}")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = _Series()
        return child

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def describe(self):
        return [self._family()]

    def collect(self):
        family = self._family()
        if self.labelnames:
            for key, child in list(self._children.items()):
                family.add_metric(list(key), child.value)
        else:
            family.add_metric([], self.value)
        return [family]


class LoopHistogram:
    """prometheus_client's Histogram without labels: observe(amount)."""

    def __init__(self, name: str, documentation: str, buckets, registry=None):
        bounds = sorted(float(b) for b in buckets)
        if bounds and math.isinf(bounds[-1]):
            bounds.pop()
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(bounds)
        self.le = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        # counts[i]: observations in (bounds[i-1], bounds[i]]; the last, above every bound
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        if registry is not None:
            registry.register(self)

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self):
        counts = list(self.counts)
        total = self.sum
        cumulative, running = [], 0
        for le, count in zip(self.le, counts):
            running += count
            cumulative.append((le, running))
        return [HistogramMetricFamily(self.name, self.documentation, buckets=cumulative,
                                      sum_value=total)]
