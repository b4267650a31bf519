"""Cost of one engine report on the pipe between a replica's engine process
and its worker (replica_worker/worker/engine_wire.py), per report.

    python -m benchmarks.engine.report_encoding [--deltas 256] [--repeats 300]

A report of N one-token deltas (one decode step of N requests), encoded on the
engine's own thread and decoded on the worker's. Beside the current encoding
it times the figures' row made with dataclasses.astuple, which the encoding
used before (one run, interleaved). Best and p50 ms of --repeats; saves
benchmarks/results/engine_report_encoding_cpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from unittest import mock

from benchmarks.common import save_result, summarize
from replica_worker.engine.outputs import DeltaStats, EngineLoad, RequestDelta, StepResult
from replica_worker.engine.schedulers.base import AdmissionCapacity
from replica_worker.worker import engine_wire
from replica_worker.worker.engine_loop import EngineReport


def decode_step_report(num_deltas: int) -> EngineReport:
    deltas = [RequestDelta(f"req-{i:08d}-0123456789ab", [1234], " word", 100, None, None,
                           DeltaStats(1.0, 2.0, 1024, 0, 0, 0, (3.0,), 2.9)) for i in range(num_deltas)]
    return EngineReport(StepResult(deltas, num_deltas, num_deltas, 0, 0.02), AdmissionCapacity(0, 0),
                        EngineLoad(num_deltas, 0, 1000, 5000), tuple(d.request_id for d in deltas), 7)


def ms(fn) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deltas", type=int, default=256)
    p.add_argument("--repeats", type=int, default=300)
    a = p.parse_args(argv)
    report = decode_step_report(a.deltas)
    data = engine_wire.encode_report(report)
    assert engine_wire.decode_report(data) == report, "the encoding does not round-trip"
    as_tuple = mock.patch.object(engine_wire, "_stats_row", lambda s: list(dataclasses.astuple(s)))
    samples = {"encode": [], "encode_astuple": [], "decode": []}
    for _ in range(a.repeats):
        samples["encode"].append(ms(lambda: engine_wire.encode_report(report)))
        with as_tuple:
            samples["encode_astuple"].append(ms(lambda: engine_wire.encode_report(report)))
        samples["decode"].append(ms(lambda: engine_wire.decode_report(data)))
    rows = {k: {"best_ms": min(v), "ms": summarize(v)} for k, v in samples.items()}
    for k, row in rows.items():
        print(f"{k:>16}: best {row['best_ms']:.3f} ms, p50 {row['ms']['p50']:.3f} ms")
    path = save_result("engine_report_encoding_cpu", {"deltas": a.deltas, "repeats": a.repeats,
                                                      "report_bytes": len(data), "results": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
