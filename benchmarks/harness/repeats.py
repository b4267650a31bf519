"""python -m benchmarks repeats --out DIR/NAME LABEL=RUN.json ...

Gathers repeated `compare` runs (same load, other seeds) and `capacity`
searches (their capacity_req_s, under the policy searched) into one table:
for every label (say, the engine cache on or off) and policy, the median of
each figure over the repeats and its range (min, max), as JSON, CSV and bar
plots with the range drawn. On a small shared machine one run says little;
the spread of a few says how much.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from benchmarks.harness import plots
from benchmarks.harness.workload import results_rate_unit

FIGURES = ("capacity_req_s", "ttft_p50_s", "ttft_p99_s", "tbt_p99_s", "throughput_req_s",
           "engine_hit_rate", "router_hit_rate", "oracle_hit_rate")


def rows_of(result: dict, path: str):
    """(policy, {figure: value}) of a compare result (each load's rows) or a capacity search.
    A compare run of several loads names each row "policy @ load": a policy's figures
    at 70% and at 90% are not repeats of one another."""
    if result.get("kind") == "compare":
        table = result["table"]
        for load, by_policy in table.items():
            for policy, row in by_policy.items():
                yield (policy if len(table) == 1 else f"{policy} @ {load}"), row
    elif result.get("kind") == "capacity":
        yield result["target"]["policy"], {"capacity_req_s": result["capacity_req_s"]}
    else:
        raise SystemExit(f"{path} is neither a compare nor a capacity result")


def load(inputs: list[str]) -> list[tuple[str, str, dict]]:
    """(label, path, result) of each LABEL=PATH (or PATH: label "all"), each file read once."""
    out = []
    for item in inputs:
        label, _, path = item.partition("=") if "=" in item else ("", "", item)
        out.append((label or "all", path, json.loads(Path(path).read_text())))
    return out


def gather(loaded: list[tuple[str, str, dict]]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """label -> policy -> figure -> the values of every repeat."""
    out: dict = {}
    for label, path, result in loaded:
        for policy, row in rows_of(result, path):
            figures = out.setdefault(label, {}).setdefault(policy, {})
            for f in FIGURES:
                if row.get(f) is not None:
                    figures.setdefault(f, []).append(row[f])
    return out


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values), "values": values}


def main(out: str, inputs: list[str], title: str = "") -> int:
    stem = Path(out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    loaded = load(inputs)
    data = gather(loaded)
    table = {label: {policy: {f: summary(v) for f, v in figs.items()} for policy, figs in by.items()}
             for label, by in data.items()}
    stem.with_suffix(".json").write_text(json.dumps(
        {"kind": "repeats", "inputs": inputs, "table": table}, indent=2) + "\n")
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "policy", "repeats", *[f"{x}_{s}" for x in FIGURES for s in ("median", "min", "max")]])
        for label, by in table.items():
            for policy, figs in by.items():
                n = max((s["n"] for s in figs.values()), default=0)
                cells = []
                for x in FIGURES:
                    s = figs.get(x)
                    cells += [f"{s[k]:.4f}" if s else "" for k in ("median", "min", "max")]
                w.writerow([label, policy, n, *cells])
    unit = results_rate_unit(result for _, _, result in loaded)
    for figure, ylabel in (("capacity_req_s", f"capacity ({unit})"), ("ttft_p50_s", "TTFT p50 (s)"),
                           ("ttft_p99_s", "TTFT p99 (s)"), ("engine_hit_rate", "engine prefix hit rate")):
        rows, spread = [], []
        for label, by in table.items():
            rows.append((label, {p: figs[figure]["median"] for p, figs in by.items() if figure in figs}))
            spread.append({p: (figs[figure]["min"], figs[figure]["max"])
                           for p, figs in by.items() if figure in figs})
        if not any(values for _, values in rows):
            continue
        plots.bar_plot(Path(f"{stem}-{figure.replace('_s', '').replace('_', '-')}.png"), rows, ylabel,
                       f"{title}: {ylabel}, median and range of repeats" if title else ylabel, spread)
    for label, by in table.items():
        for policy, figs in by.items():
            print(f"{label:>10} {policy:<18} " + "  ".join(
                f"{x} {figs[x]['median']:.3f} [{figs[x]['min']:.3f}, {figs[x]['max']:.3f}]"
                for x in ("capacity_req_s", "ttft_p50_s", "ttft_p99_s", "engine_hit_rate") if x in figs))
    return 0
