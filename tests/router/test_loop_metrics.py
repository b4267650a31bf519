"""The loop's counters and histograms expose what prometheus_client's own would
for the same updates (less the `_created` series), and refuse what they refuse."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (0.001, 0.01, 0.1, 1, 10)


def exposition(registry) -> list[str]:
    return sorted(line for line in generate_latest(registry).decode().splitlines()
                  if "_created" not in line)


def both(make_ours, make_theirs):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    return make_ours(ours), make_theirs(theirs), ours, theirs


def test_counters_expose_the_same_text():
    (plain, labelled), (plain_ref, labelled_ref), ours, theirs = both(
        lambda r: (LoopCounter("q_things_total", "Things", registry=r),
                   LoopCounter("q_kinds_total", "Kinds", ["kind"], registry=r)),
        lambda r: (Counter("q_things_total", "Things", registry=r),
                   Counter("q_kinds_total", "Kinds", ["kind"], registry=r)))
    for counter in (plain, plain_ref):
        counter.inc()
        counter.inc(2.5)
    for counter in (labelled, labelled_ref):
        counter.labels("a").inc()
        counter.labels("b").inc(3)
        counter.labels("a").inc()
    assert exposition(ours) == exposition(theirs)
    assert "q_kinds_total{kind=\"a\"} 2.0" in exposition(ours)


def test_histograms_expose_the_same_text():
    ours_h, theirs_h, ours, theirs = both(
        lambda r: LoopHistogram("q_wait_seconds", "Wait", buckets=BUCKETS, registry=r),
        lambda r: Histogram("q_wait_seconds", "Wait", buckets=BUCKETS, registry=r))
    # on a bound, between bounds, below the first, above the last
    for value in (0.001, 0.0005, 0.05, 1, 7, 10, 11, 1e6, 0):
        ours_h.observe(value)
        theirs_h.observe(value)
    assert exposition(ours) == exposition(theirs)


def test_an_empty_histogram_and_counter_expose_zeros():
    ours_h, theirs_h, ours, theirs = both(
        lambda r: (LoopHistogram("q_e_seconds", "E", buckets=BUCKETS, registry=r),
                   LoopCounter("q_n_total", "N", registry=r)),
        lambda r: (Histogram("q_e_seconds", "E", buckets=BUCKETS, registry=r),
                   Counter("q_n_total", "N", registry=r)))
    assert exposition(ours) == exposition(theirs)


def test_refusals():
    registry = CollectorRegistry()
    counter = LoopCounter("q_x_total", "X", registry=registry)
    labelled = LoopCounter("q_y_total", "Y", ["kind"], registry=registry)
    with pytest.raises(ValueError, match="only goes up"):
        counter.inc(-1)
    with pytest.raises(ValueError, match="only goes up"):
        labelled.labels("a").inc(-1)
    with pytest.raises(ValueError, match="use labels"):
        labelled.inc()
    with pytest.raises(ValueError, match="takes labels"):
        labelled.labels("a", "b")
    with pytest.raises(ValueError, match="Duplicated"):
        LoopCounter("q_x_total", "X again", registry=registry)
