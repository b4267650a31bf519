"""python -m benchmarks prefix-report RUNS_DIR --out REPORT.json

The cache-affine targets, checked on the runs benchmarks/prefix_affinity_cpu.sh
writes into RUNS_DIR (one file a run, named by workload, what and seed):

  WL_cap_POLICY_cacheon_seedK.json    capacity search of POLICY, engine cache on
  WL_cap_pull_cacheoff_seedK.json     the same, engine cache off
  WL_70pct_seedK.json                 compare of every policy at 70% of pull_fifo's capacity

Per workload and seed: pull's capacity over round_robin's (target >= 2) and
over cache_aware's (>= 1.1); pull's p50 TTFT over pull_fifo's at 70% load
(<= 0.5); pull's engine hit rate over the oracle's in the same run (>= 0.9,
"within 10%"). Each ratio is taken within one seed (the same requests), then
reported per seed, as the median, and as whether it holds in every seed.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

TARGETS = {   # name: (what, bound, at least or at most)
    "capacity_vs_round_robin": ("pull capacity / round_robin capacity", 2.0, "min"),
    "capacity_vs_cache_aware": ("pull capacity / cache_aware capacity", 1.1, "min"),
    "ttft_p50_vs_fifo_at_70pct": ("pull p50 TTFT / pull_fifo p50 TTFT at 70% load", 0.5, "max"),
    "hit_rate_vs_oracle": ("pull engine hit rate / oracle hit rate (70% run)", 0.9, "min"),
}
_NAME = re.compile(r"(?P<wl>[a-z]+)_(?:cap_(?P<policy>[a-z_]+)_cache(?P<cache>on|off)|(?P<load>70pct))"
                   r"_seed(?P<seed>\d+)\.json$")


def load_runs(runs: Path) -> dict:
    """workload -> seed -> {"capacity": {(policy, cache): req/s}, "load": compare table row by policy}."""
    out: dict = {}
    for path in sorted(runs.glob("*.json")):
        m = _NAME.match(path.name)
        if not m:
            continue
        result = json.loads(path.read_text())
        seed = out.setdefault(m["wl"], {}).setdefault(int(m["seed"]), {"capacity": {}, "load": {}})
        if m["load"]:
            (table,) = result["table"].values()
            seed["load"] = table
        else:
            seed["capacity"][(m["policy"], m["cache"])] = result["capacity_req_s"]
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def seed_ratios(seed: dict) -> dict:
    cap, load = seed["capacity"], seed["load"]
    pull, fifo = load.get("pull", {}), load.get("pull_fifo", {})
    return {
        "capacity_vs_round_robin": _ratio(cap.get(("pull", "on")), cap.get(("round_robin", "on"))),
        "capacity_vs_cache_aware": _ratio(cap.get(("pull", "on")), cap.get(("cache_aware", "on"))),
        "ttft_p50_vs_fifo_at_70pct": _ratio(pull.get("ttft_p50_s"), fifo.get("ttft_p50_s")),
        "hit_rate_vs_oracle": _ratio(pull.get("engine_hit_rate"), pull.get("oracle_hit_rate")),
        "capacity_cache_on_vs_off": _ratio(cap.get(("pull", "on")), cap.get(("pull", "off"))),
    }


def _holds(value, bound, kind) -> bool | None:
    if value is None:
        return None
    return value >= bound if kind == "min" else value <= bound


def report(runs: Path) -> dict:
    out = {}
    for wl, seeds in load_runs(runs).items():
        per_seed = {k: seed_ratios(v) for k, v in sorted(seeds.items())}
        capacities = {f"{p}_cache{c}": [s["capacity"].get((p, c)) for s in seeds.values()]
                      for p, c in sorted({key for s in seeds.values() for key in s["capacity"]})}
        targets = {}
        for name, (what, bound, kind) in TARGETS.items():
            values = [r[name] for r in per_seed.values() if r[name] is not None]
            median = statistics.median(values) if values else None
            targets[name] = {"what": what, "bound": bound, "kind": kind,
                             "per_seed": [r[name] for r in per_seed.values()], "median": median, "holds_by_median": _holds(median, bound, kind),
                             "holds_in_every_seed": bool(values) and all(_holds(v, bound, kind) for v in values)}
        cache = [r["capacity_cache_on_vs_off"] for r in per_seed.values()]
        out[wl] = {"seeds": sorted(seeds), "capacity_req_s": capacities, "targets": targets,
                   "capacity_cache_on_vs_off": cache}
    return out


def main(runs: str, out: str) -> int:
    result = report(Path(runs))
    Path(out).write_text(json.dumps({"kind": "prefix_report", "runs": runs, "workloads": result},
                                    indent=2) + "\n")
    for wl, r in result.items():
        print(f"{wl}: seeds {r['seeds']}")
        for name, cap in r["capacity_req_s"].items():
            print(f"  capacity {name:<24} " + " ".join("-" if c is None else f"{c:.2f}" for c in cap))
        for name, t in r["targets"].items():
            vals = " ".join("-" if v is None else f"{v:.2f}" for v in t["per_seed"])
            print(f"  {t['what']:<52} {vals}  median {t['median'] if t['median'] is None else round(t['median'], 2)}"
                  f" ({'>=' if t['kind'] == 'min' else '<='} {t['bound']}): "
                  f"{'holds' if t['holds_by_median'] else 'fails'} by median, "
                  f"{'in every seed' if t['holds_in_every_seed'] else 'not in every seed'}")
    return 0
