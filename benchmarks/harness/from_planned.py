"""A finished run's latency again, from its per-request CSVs, counted from each
request's planned arrival (as the harness counts it now) beside the send it
recorded then: how much a load generator that sent late hid from runs measured
before latency counted from the plan.

    python -m benchmarks.harness.from_planned benchmarks/results/harness/cpu_policies/*pct.csv \
        --out cpu_policies_from_planned
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from benchmarks.common import percentile, save_result


def from_csv(path: Path) -> dict:
    rows = [r for r in csv.DictReader(open(path)) if r["finish_reason"] in ("length", "stop")
            and not r["error"]]
    planned = [float(r["first_token_s"]) - float(r["scheduled_s"]) for r in rows]
    sent = [float(r["first_token_s"]) - float(r["sent_s"]) for r in rows]
    lag = [float(r["sent_s"]) - float(r["scheduled_s"]) for r in rows]
    return {"requests": len(rows),
            "ttft_p50_s": {"from_planned": percentile(planned, 50), "from_send": percentile(sent, 50)},
            "ttft_p99_s": {"from_planned": percentile(planned, 99), "from_send": percentile(sent, 99)},
            "send_lag_s": {"p99": percentile(lag, 99), "max": max(lag, default=None)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csvs", nargs="+", type=Path)
    ap.add_argument("--out", required=True, help="result name under benchmarks/results")
    a = ap.parse_args(argv)
    runs = {p.stem: from_csv(p) for p in a.csvs}
    for name, r in runs.items():
        print(f"{name}: p99 TTFT {r['ttft_p99_s']['from_send']:.3f} s from the send, "
              f"{r['ttft_p99_s']['from_planned']:.3f} s from the plan; sends up to "
              f"{r['send_lag_s']['max']:.3f} s late")
    print(f"wrote {save_result(a.out, {'runs': runs})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
