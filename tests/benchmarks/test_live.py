"""Short live runs: the harness starts a stack (2 replicas, tiny model), sends a few
requests and writes JSON, CSV and PNGs; every request ends with its exact length."""

import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _harness(tmp_path, *args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks", *args, "--start-stack", "--replicas", "2",
           "--prompt-dist", "uniform", "--prompt-min", "8", "--prompt-max", "48", "--output-dist", "uniform",
           "--output-min", "4", "--output-max", "16", "--warmup", "1", "--hardware", "none", "--seed", "3",
           "--out-dir", str(tmp_path), "--name", args[0], "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / f"{args[0]}.json").read_text())


def test_harness_live_compare(tmp_path):
    result = _harness(tmp_path, "compare", "--policies", "pull", "round_robin", "--rates", "15", "-n", "8")
    [key] = result["table"]
    assert set(result["table"][key]) == {"pull", "round_robin"}
    for policy, row in result["table"][key].items():
        assert row["errors"] == 0 and row["server_ttft_p99_s"] > 0, (policy, row)
    check = result["pull_vs_round_robin"][key]
    assert check["ratio"] > 0 and check["server_ratio"] > 0
    assert (tmp_path / f"compare-{key.replace(' ', '').replace('/', '')}-cdf.png").stat().st_size > 0


def test_harness_live_capacity_search(tmp_path):
    """Two probes: the first (a low rate) must pass; the JSON keeps both, complete.
    At 1 req/s six arrivals span seconds, so one admission a busy machine delays by
    a tenth of a second does not fail the keep-up rule (it did at 2 req/s, once)."""
    result = _harness(tmp_path, "capacity", "--initial-rate", "1", "--max-probes", "2", "-n", "6",
                      "--tbt-slo", "5")
    assert result["complete"] is True and len(result["probes"]) == 2
    assert result["rule"] == {"tbt_p99_s": 5.0, "sched_delay_p50_s": 2.0, "keep_up": 0.9, "ttft_p99_s": None}
    assert result["probes"][0]["passed"], result["probes"][0]
    assert result["capacity_req_s"] >= 1
    assert all(p["summary"]["offered_req_s"] and p["summary"]["admitted_req_s"] for p in result["probes"])
    assert (tmp_path / "capacity-capacity.png").stat().st_size > 0


def test_harness_multi_turn_builds_each_turn_from_the_answers(tmp_path):
    """Every later turn's prompt is the earlier prompt, the answer and a new
    message: the router counts exactly the planned prompt tokens for each, and
    the replicas find the earlier turns cached."""
    result = _harness(tmp_path, "run", "--workload", "multi-turn", "--conversations", "4", "--turns", "3",
                      "--system-len", "0", "--rate", "5")
    for name in ("run.json", "run.csv", "run-summary.csv", "run-cdf.png", "run-load.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert result["command"].startswith("python -m benchmarks run")
    s = result["summary"]
    assert s["requests"] == s["finished"] == s["exact_output_length"] == 12, s
    assert s["ttft_s"]["p50"] is not None and s["tbt_s"]["n"] > 0
    rows = list(csv.DictReader(open(tmp_path / "run.csv")))
    assert len(rows) == 12
    for row in rows:
        assert row["finish_reason"] == "length" and row["output_tokens"] == row["output_len"]
        assert row["replica"].startswith("replica-") and float(row["ttft_s"]) > 0
    assert sorted(int(r["prompt_len"]) for r in rows) == sorted(int(r["server_prompt_tokens"]) for r in rows)
    assert all(r["prompt_len"] == r["server_prompt_tokens"] for r in rows)
    hits = s["prefix_cache"]
    assert hits["engine_hit_rate"] > 0 and hits["oracle_hit_rate"] >= hits["router_hit_rate"] > 0
    assert 0 < s["workload_reusable_prompt_share"] < 1


def test_priming_caches_every_shared_prefix_before_the_measured_run(tmp_path):
    """3 groups of a 64-token system prompt (4 blocks), 2 questions each: primed,
    every request finds its whole system prompt cached (6 x 64 tokens); unprimed,
    each group's first request finds nothing of it."""
    shape = ("--workload", "shared-prefix", "--groups", "3", "--questions", "2", "--system-len", "64",
             "--rate", "50")
    hits = {}
    for label, extra in (("primed", ("--prime",)), ("cold", ())):
        out = tmp_path / label
        out.mkdir()
        s = _harness(out, "run", *shape, *extra)["summary"]
        assert s["requests"] == s["exact_output_length"] == 6, s
        hits[label] = s["prefix_cache"]["engine_hit_tokens"]
    assert hits["primed"] == 6 * 64
    assert hits["cold"] <= 3 * 64


def test_cold_probes_start_every_probe_with_empty_caches(tmp_path):
    """--cold-probes: a stack of its own for each probe, so the second probe of a
    multi-turn search (the same conversations again) finds no history cached from
    the first: its hit rate stays where the first probe's is, not near all."""
    cmd = [sys.executable, "-m", "benchmarks", "capacity", "--cold-probes", "--initial-rate", "2",
           "--max-probes", "2", "--tbt-slo", "5", "--start-stack", "--replicas", "2", "--workload", "multi-turn",
           "--conversations", "4", "--turns", "3", "--system-len", "0", "--prompt-dist", "uniform",
           "--prompt-min", "40", "--prompt-max", "48", "--output-dist", "fixed", "--output-len", "8",
           "--warmup", "0", "--hardware", "none", "--seed", "3", "--out-dir", str(tmp_path),
           "--name", "cold", "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("starting stack") == 2, proc.stderr[-3000:]
    first, second = (p["summary"]["prefix_cache"]["engine_hit_rate"]
                     for p in json.loads((tmp_path / "cold.json").read_text())["probes"])
    assert 0 < first < 0.9 and 0 < second < 0.9, (first, second)
