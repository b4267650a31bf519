"""Repeated compare runs gathered into median and range per label and policy."""

import csv
import json

import pytest

from benchmarks.harness import repeats
from benchmarks.harness.workload import results_rate_unit


def compare_json(path, rows: dict) -> str:
    path.write_text(json.dumps({"kind": "compare", "table": {"30 req/s": rows}}))
    return str(path)


def test_repeats_gives_median_and_range_per_label_and_policy(tmp_path):
    runs = [({"pull": {"ttft_p50_s": t, "engine_hit_rate": h}, "round_robin": {"ttft_p50_s": 2 * t}}, "on")
            for t, h in ((0.1, 0.8), (0.3, 0.9), (0.2, 0.7))]
    runs.append(({"pull": {"ttft_p50_s": 1.0, "engine_hit_rate": None}}, "off"))
    inputs = [f"{label}={compare_json(tmp_path / f'r{i}.json', rows)}" for i, (rows, label) in enumerate(runs)]
    assert repeats.main(str(tmp_path / "out"), inputs, "t") == 0
    table = json.loads((tmp_path / "out.json").read_text())["table"]
    pull = table["on"]["pull"]
    assert (pull["ttft_p50_s"]["median"], pull["ttft_p50_s"]["min"], pull["ttft_p50_s"]["max"]) == (0.2, 0.1, 0.3)
    assert pull["engine_hit_rate"]["median"] == 0.8 and pull["engine_hit_rate"]["n"] == 3
    assert table["on"]["round_robin"]["ttft_p50_s"]["median"] == 0.4
    assert "engine_hit_rate" not in table["off"]["pull"] and table["off"]["pull"]["ttft_p50_s"]["n"] == 1
    rows = list(csv.DictReader(open(tmp_path / "out.csv")))
    assert [(r["label"], r["policy"], r["repeats"]) for r in rows] == [
        ("on", "pull", "3"), ("on", "round_robin", "3"), ("off", "pull", "1")]
    for png in ("ttft-p50", "engine-hit-rate"):
        assert (tmp_path / f"out-{png}.png").stat().st_size > 0
    assert not (tmp_path / "out-ttft-p99.png").exists(), "no run had it: no plot"


def test_capacity_searches_gather_beside_compare_runs(tmp_path):
    def capacity_json(name, policy, capacity):
        path = tmp_path / name
        path.write_text(json.dumps({"kind": "capacity", "target": {"policy": policy},
                                    "capacity_req_s": capacity}))
        return str(path)

    inputs = [f"on={capacity_json('a.json', 'pull', 12.0)}", f"on={capacity_json('b.json', 'pull', 10.0)}",
              f"on={capacity_json('c.json', 'round_robin', 5.0)}",
              f"on={compare_json(tmp_path / 'd.json', {'pull': {'ttft_p50_s': 0.1}})}"]
    assert repeats.main(str(tmp_path / "out"), inputs) == 0
    table = json.loads((tmp_path / "out.json").read_text())["table"]["on"]
    assert table["pull"]["capacity_req_s"]["median"] == 11.0 and table["pull"]["ttft_p50_s"]["n"] == 1
    assert table["round_robin"]["capacity_req_s"]["values"] == [5.0]
    assert (tmp_path / "out-capacity-req.png").stat().st_size > 0
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "run"}))
    with pytest.raises(SystemExit):
        repeats.main(str(tmp_path / "out2"), [str(tmp_path / "bad.json")])


def test_capacity_of_multi_turn_runs_is_labelled_in_conversations(tmp_path):
    def capacity_json(name, workload):
        path = tmp_path / name
        path.write_text(json.dumps({"kind": "capacity", "target": {"policy": "pull"}, "capacity_req_s": 3.0,
                                    "workload": {"workload": workload}}))
        return str(path)

    def unit(inputs):
        return results_rate_unit(result for _, _, result in repeats.load(inputs))

    assert unit([f"a={capacity_json('a.json', 'multi-turn')}",
                 capacity_json("b.json", "multi-turn")]) == "conversations/s"
    assert unit([capacity_json("c.json", "shared-prefix")]) == "req/s"
    mixed = [capacity_json("d.json", "multi-turn"), capacity_json("e.json", "shared-prefix")]
    assert unit(mixed) == "req/s or conversations/s"


def test_each_load_of_a_compare_run_is_its_own_row(tmp_path):
    path = tmp_path / "two_loads.json"
    path.write_text(json.dumps({"kind": "compare", "table": {
        "70%": {"pull": {"ttft_p99_s": 0.2}}, "90%": {"pull": {"ttft_p99_s": 0.6}}}}))
    assert repeats.main(str(tmp_path / "out"), [str(path)]) == 0
    table = json.loads((tmp_path / "out.json").read_text())["table"]["all"]
    assert table["pull @ 70%"]["ttft_p99_s"]["values"] == [0.2]
    assert table["pull @ 90%"]["ttft_p99_s"]["values"] == [0.6]
