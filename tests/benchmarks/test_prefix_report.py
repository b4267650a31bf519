"""The cache-affine targets computed per seed from a folder of runs."""

import json

from benchmarks.harness import prefix_report


def write(path, payload):
    path.write_text(json.dumps(payload))


def test_targets_are_ratios_within_each_seed(tmp_path):
    caps = {1: {"pull": 12.0, "round_robin": 5.0, "cache_aware": 12.0, "pull_off": 6.0},
            2: {"pull": 10.0, "round_robin": 6.0, "cache_aware": 8.0, "pull_off": 5.0}}
    for seed, by in caps.items():
        for policy, cap in by.items():
            name, cache = (policy[:-4], "off") if policy.endswith("_off") else (policy, "on")
            write(tmp_path / f"shared_cap_{name}_cache{cache}_seed{seed}.json",
                  {"kind": "capacity", "capacity_req_s": cap})
        write(tmp_path / f"shared_70pct_seed{seed}.json", {"kind": "compare", "table": {"70%": {
            "pull": {"ttft_p50_s": 0.1, "engine_hit_rate": 0.85, "oracle_hit_rate": 0.9},
            "pull_fifo": {"ttft_p50_s": 0.25 if seed == 1 else 0.15}}}})
    write(tmp_path / "unrelated.json", {"kind": "run"})
    out = tmp_path / "report.json"
    assert prefix_report.main(str(tmp_path), str(out)) == 0
    shared = json.loads(out.read_text())["workloads"]["shared"]
    t = shared["targets"]
    assert t["capacity_vs_round_robin"]["per_seed"] == [2.4, 10 / 6]
    assert t["capacity_vs_round_robin"]["holds_by_median"] and not t["capacity_vs_round_robin"]["holds_in_every_seed"]
    assert t["capacity_vs_cache_aware"]["per_seed"] == [1.0, 1.25]
    assert t["ttft_p50_vs_fifo_at_70pct"]["per_seed"] == [0.4, 0.1 / 0.15]
    assert t["hit_rate_vs_oracle"]["holds_in_every_seed"] and t["hit_rate_vs_oracle"]["median"] == 0.85 / 0.9
    assert shared["capacity_cache_on_vs_off"] == [2.0, 2.0]
    assert shared["capacity_req_s"]["round_robin_cacheon"] == [5.0, 6.0]
