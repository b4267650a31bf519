"""python -m benchmarks {run,capacity,compare,roofline,model-dir,plot-capacity} ...

run       one load run against --router HOST:PORT or a stack it starts (--start-stack)
capacity  highest Poisson rate within p99 TBT SLO and p50 scheduling delay <= 2 s
compare   policies x loads (fractions of a capacity, or absolute rates), CDFs overlaid
roofline  hardware limit of a model shape and workload
model-dir write a config-only model folder of a known shape (dummy weights on the replica)
plot-capacity  capacity searches' JSONs overlaid in one PNG, probe by probe
repeats   repeated compare runs and capacity searches gathered: median and range per label and policy
prefix-report  the cache-affine targets, per seed, over benchmarks/prefix_affinity_cpu.sh's runs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.harness import capacity as cap
from benchmarks.harness import metrics as M
from benchmarks.harness import plots, prefix_report, prefix_stats, repeats, roofline
from benchmarks.harness.loadgen import run_requests
from benchmarks.harness.prefix_workloads import priming, reusable_tokens
from benchmarks.harness.stack import Stack
from benchmarks.harness.workload import (PREFIX_WORKLOADS, PRESETS, WorkloadSpec, generate,
                                         rate_unit, vocab_size_of)

# A name the harness runs: a router policy, with the router flags that make it.
POLICY_VARIANTS = {
    "pull": ("pull", []),                                      # with affinity (the default)
    "pull_fifo": ("pull", ["--pull-affinity-window", "0"]),    # strict FIFO
    # with affinity and a load term: cache_aware's default margins (8192 tokens, 1.5x)
    "pull_balanced": ("pull", ["--pull-affinity-balance-abs", "8192"]),
    "round_robin": ("round_robin", []),
    "least_outstanding": ("least_outstanding", []),
    "cache_aware": ("cache_aware", []),
}
POLICIES = tuple(POLICY_VARIANTS)
# What compare runs unless told: every router policy and strict FIFO (the load-term
# variant only when named, so the documented commands keep their meaning).
COMPARED_BY_DEFAULT = tuple(p for p in POLICIES if p != "pull_balanced")
# Hit metrics for every policy, so they compare (hashing every prompt costs little).
STACK_ROUTER_ARGS = ["--prefix-metrics", "all"]


# ---------------------------------------------------------------- arguments
def add_workload_args(p):
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="synthetic",
                   choices=("synthetic", "trace", *PRESETS, *PREFIX_WORKLOADS))
    g.add_argument("--trace", help="CSV with prompt/output length columns and optional arrival_s")
    g.add_argument("--num-requests", "-n", type=int, default=100)
    g.add_argument("--scale", type=float, default=1.0, help="multiply preset/trace lengths (tiny model: 0.125)")
    g.add_argument("--max-total", type=int, help="prompt + output limit; default: the preset's times --scale")
    for what, length, lo, hi in (("prompt", 128, 16, 512), ("output", 64, 8, 256)):
        g.add_argument(f"--{what}-dist", default="fixed", choices=("fixed", "uniform", "zipf"))
        g.add_argument(f"--{what}-len", type=int, default=length, help="fixed length")
        g.add_argument(f"--{what}-min", type=int, default=lo)
        g.add_argument(f"--{what}-max", type=int, default=hi)
    g.add_argument("--zipf-theta", type=float, default=1.2)
    g.add_argument("--arrival", default="poisson", choices=("poisson", "gamma", "burst", "trace"))
    g.add_argument("--rate", type=float,
                   help="requests/s (multi-turn: conversations started a second); unset: all at once")
    g.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--vocab-size", type=int, help="default: the model's config.json (512 without one)")
    g.add_argument("--groups", type=int, default=8, help="shared-prefix: system prompts")
    g.add_argument("--questions", type=int, default=16, help="shared-prefix: requests per system prompt")
    g.add_argument("--system-len", type=int, default=256,
                   help="shared-prefix: tokens of each group's system prompt; multi-turn: of the "
                        "one every conversation starts with (0: none)")
    g.add_argument("--conversations", type=int, default=32, help="multi-turn: conversations")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    g.add_argument("--think-s", type=float, default=0.0,
                   help="multi-turn: seconds between an answer and the next turn")


def add_target_args(p):
    g = p.add_argument_group("system under test")
    g.add_argument("--router", default=os.environ.get("QUADRIGA_ROUTER_ADDRESS"),
                   help="HOST:PORT of a live router (env QUADRIGA_ROUTER_ADDRESS)")
    g.add_argument("--metrics-url", help="router's /metrics URL, scraped for quadriga_inflight_requests")
    g.add_argument("--start-stack", action="store_true", help="start `python -m stack` for the run")
    g.add_argument("--policy", default="pull", choices=POLICIES)
    g.add_argument("--replicas", type=int, default=2)
    g.add_argument("--model", help="model folder (default with --start-stack: the tiny model)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--scheduler", help="replica scheduler (sarathi, vllm, ...)")
    g.add_argument("--replica-arg", action="append", default=[], help="passed to every replica")
    g.add_argument("--stack-arg", action="append", default=[], help="passed to python -m stack")
    g.add_argument("--router-arg", action="append", default=[], help="passed to the router (--start-stack)")
    g.add_argument("--replica-metrics-url", action="append", default=[],
                   help="a replica's /metrics (prefix cache hit rate); --start-stack finds its own")
    g.add_argument("--stack-log-dir")
    g.add_argument("--channels", type=int, default=2)
    g.add_argument("--stream-interval", type=int, default=1)
    g.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    g.add_argument("--warmup", type=int, default=4, help="unmeasured requests sent first (per stack)")
    g.add_argument("--prime", action="store_true",
                   help="shared-prefix and multi-turn: send each shared system prompt once, "
                        "unmeasured, after the warm-up, so the first probe meets caches as warm "
                        "as the later ones do (per stack)")
    g.add_argument("--no-progress", action="store_true")


def add_slo_args(p):
    g = p.add_argument_group("SLO")
    g.add_argument("--ttft-slo", type=float, default=1.0, help="seconds")
    g.add_argument("--tbt-slo", type=float, default=0.1, help="seconds")
    g.add_argument("--tbt-slo-stat", default="p99", choices=("p99", "max", "mean"),
                   help="per-request TBT statistic for goodput")
    g.add_argument("--sched-delay-slo", type=float, default=2.0, help="capacity: p50 scheduling delay bound")
    g.add_argument("--ttft-p99-slo", type=float, help="capacity: p99 TTFT bound too (seconds)")


def add_hw_args(p):
    g = p.add_argument_group("roofline")
    g.add_argument("--hardware", default="cpu", choices=("cpu", "h200", "h100", "gpu", "none"),
                   help="cpu: measured memcpy and torch matmul here; h200: 4.3 TB/s, 790 TFLOP/s; "
                        "h100: 2.95 TB/s, 744 TFLOP/s (rates measured on one); gpu: h100 or h200, "
                        "as nvidia-smi names GPU 0 (another card: no roofline)")
    g.add_argument("--bandwidth", type=float, help="bytes/s (overrides --hardware)")
    g.add_argument("--flops", type=float, help="FLOP/s (overrides --hardware)")
    g.add_argument("--dtype-bytes", type=int, help="default: from config (float32 4, else 2)")
    g.add_argument("--roofline-batch", type=int, help="decode batch; default: --max-num-seqs replica arg or 128")


def add_output_args(p, default_name):
    g = p.add_argument_group("output")
    g.add_argument("--name", default=default_name, help="file stem of the results")
    g.add_argument("--out-dir", default=str(RESULTS / "harness"), help="per-request CSVs and detail PNGs")
    g.add_argument("--summary-dir", default=None, help="summary JSON/PNG (default: --out-dir)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one load run")
    add_workload_args(r), add_target_args(r), add_slo_args(r), add_hw_args(r), add_output_args(r, "run")
    c = sub.add_parser("capacity", help="capacity search")
    add_workload_args(c), add_target_args(c), add_slo_args(c), add_hw_args(c), add_output_args(c, "capacity")
    c.add_argument("--initial-rate", type=float, default=2.0)
    c.add_argument("--max-probes", type=int, default=7)
    c.add_argument("--rel-tol", type=float, default=0.1)
    c.add_argument("--growth", type=float, default=2.0,
                   help="bracketing factor from --initial-rate (1.25: the initial rate is a good guess)")
    c.add_argument("--cold-probes", action="store_true",
                   help="with --start-stack: a fresh stack for every probe, so no probe starts with "
                        "caches an earlier one filled (a workload replayed probe after probe, e.g. "
                        "multi-turn, otherwise finds its histories cached)")
    m = sub.add_parser("compare", help="policies x loads")
    add_workload_args(m), add_target_args(m), add_slo_args(m), add_hw_args(m), add_output_args(m, "compare")
    m.add_argument("--policies", nargs="+", default=list(COMPARED_BY_DEFAULT), choices=POLICIES)
    m.add_argument("--capacity", type=float,
                   help="the rate --loads are fractions of (req/s; conversations/s for multi-turn)")
    m.add_argument("--find-capacity", action="store_true", help="search it first with the first policy")
    m.add_argument("--loads", nargs="+", type=float, default=[0.7, 0.9])
    m.add_argument("--rates", nargs="+", type=float, help="absolute rates instead of --loads")
    m.add_argument("--initial-rate", type=float, default=2.0)
    m.add_argument("--max-probes", type=int, default=7)
    m.add_argument("--rel-tol", type=float, default=0.1)
    m.add_argument("--growth", type=float, default=2.0)
    m.add_argument("--capacity-requests", type=int, help="requests per capacity probe (default -n)")
    f = sub.add_parser("roofline", help="hardware limit of a shape and workload")
    add_workload_args(f), add_hw_args(f)
    f.add_argument("--model", help="model folder or config.json")
    f.add_argument("--replicas", type=int, default=1)
    f.add_argument("--replica-arg", action="append", default=[])
    d = sub.add_parser("model-dir", help="config-only model folder of a known shape")
    d.add_argument("out")
    d.add_argument("--shape", default="llama-3.1-8b", choices=tuple(MODEL_SHAPES))
    k = sub.add_parser("plot-capacity", help="capacity searches' JSONs overlaid in one PNG")
    k.add_argument("results", nargs="+", help="capacity JSONs; LABEL=PATH names a line (default: the file name)")
    k.add_argument("--out", required=True, help="the PNG to write")
    k.add_argument("--title", default="")
    e = sub.add_parser("repeats", help="repeated compare runs and capacity searches: median and range")
    e.add_argument("results", nargs="+", help="compare or capacity JSONs; LABEL=PATH groups them")
    e.add_argument("--out", required=True, help="path stem of the JSON, CSV and PNGs")
    e.add_argument("--title", default="")
    t = sub.add_parser("prefix-report", help="cache-affine targets over a folder of runs")
    t.add_argument("runs", help="the runs folder (WL_cap_POLICY_cacheon_seedK.json, WL_70pct_seedK.json)")
    t.add_argument("--out", required=True, help="the report JSON")
    return p.parse_args(argv)


# ---------------------------------------------------------------- helpers
def reproduce_command() -> str:
    return " ".join(shlex.quote(a) for a in ["python", "-m", "benchmarks", *sys.argv[1:]])


def write_json(path: Path, payload: dict) -> Path:
    """Same header as benchmarks.common.save_result (command, when, machine), any path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": reproduce_command(),
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": {"platform": platform.platform(), "python": platform.python_version()},
               **payload}
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    return path


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def resolve_model(a) -> str | None:
    if getattr(a, "model", None):
        return a.model
    if getattr(a, "start_stack", False) or a.cmd == "roofline":
        from stack.__main__ import default_model
        return default_model()
    return None


def spec_from(a, model: str | None) -> WorkloadSpec:
    return WorkloadSpec(
        num_requests=a.num_requests, workload=a.workload, trace=a.trace, prompt_dist=a.prompt_dist,
        prompt_len=a.prompt_len, prompt_min=a.prompt_min, prompt_max=a.prompt_max,
        output_dist=a.output_dist, output_len=a.output_len, output_min=a.output_min,
        output_max=a.output_max, zipf_theta=a.zipf_theta, scale=a.scale, max_total=a.max_total,
        arrival=a.arrival, rate=a.rate, cv=a.cv, seed=a.seed,
        vocab_size=a.vocab_size or vocab_size_of(model), groups=a.groups, questions=a.questions,
        system_len=a.system_len, conversations=a.conversations, turns=a.turns, think_s=a.think_s)


def slo_from(a) -> M.SLO:
    return M.SLO(a.ttft_slo, a.tbt_slo, a.tbt_slo_stat, a.sched_delay_slo, a.ttft_p99_slo)


def _replica_flag(args: list[str], flag: str) -> str | None:
    for i, x in enumerate(args):
        if x == flag and i + 1 < len(args):
            return args[i + 1]
        if x.startswith(flag + "="):
            return x.split("=", 1)[1]
    return None


_HW_CACHE: dict = {}


def hardware_from(a) -> roofline.Hardware | None:
    if a.hardware == "none" and not (a.bandwidth and a.flops):
        return None
    card = roofline.gpu_card() if a.hardware == "gpu" else a.hardware
    if card not in _HW_CACHE:
        given = {"h200": (roofline.H200, "h200 (datasheet)"),
                 "h100": (roofline.H100, "h100 (measured rates)")}.get(card)
        _HW_CACHE[card] = (roofline.measure_cpu() if card == "cpu"
                           else roofline.Hardware(**given[0], name=given[1]) if given else None)
    base = _HW_CACHE[card]
    bw = a.bandwidth or (base.bandwidth_Bps if base else None)
    fl = a.flops or (base.flops if base else None)
    name = base.name if base and not (a.bandwidth or a.flops) else "given"
    return roofline.Hardware(bw, fl, name)


def limit_for(a, model: str | None, requests) -> dict | None:
    hw = hardware_from(a)
    if hw is None or not model or not requests:
        return None
    try:
        shape = roofline.Shape.from_config(model, a.dtype_bytes)
    except (OSError, KeyError, ValueError) as exc:
        log(f"roofline skipped: {exc}")
        return None
    batch = a.roofline_batch or int(_replica_flag(a.replica_arg, "--max-num-seqs") or 128)
    return roofline.workload_limit(
        shape, hw, mean_prompt=sum(r.prompt_len for r in requests) / len(requests),
        mean_output=sum(r.output_len for r in requests) / len(requests), batch=batch,
        replicas=getattr(a, "replicas", 1))


class Target:
    """A live router, or a stack started (and stopped) here."""

    def __init__(self, a, policy: str | None = None, model: str | None = None):
        self.a, self.policy, self.model = a, policy or a.policy, model
        self.stack: Stack | None = None
        self.address, self.metrics_url = a.router, a.metrics_url
        self.replica_metrics_urls = list(a.replica_metrics_url)

    def __enter__(self):
        a = self.a
        if a.start_stack:
            log(f"starting stack: {a.replicas} replicas, policy {self.policy}")
            policy, variant_args = POLICY_VARIANTS[self.policy]
            self.stack = Stack(replicas=a.replicas, policy=policy, model=self.model,
                               replica_args=a.replica_arg, device=a.device, scheduler=a.scheduler,
                               extra_args=a.stack_arg, log_dir=a.stack_log_dir and
                               str(Path(a.stack_log_dir) / self.policy),
                               router_args=[*STACK_ROUTER_ARGS, *variant_args, *a.router_arg]).start()
            self.address, self.metrics_url = self.stack.address, self.stack.metrics_url
            self.replica_metrics_urls = self.stack.replica_metrics_urls
            log(f"stack ready at {self.address} (logs {self.stack.log_dir})")
        elif not self.address:
            raise SystemExit("give --router HOST:PORT or --start-stack")
        if a.warmup:
            spec = spec_from(a, self.model)
            spec.num_requests, spec.seed, spec.workload = a.warmup, spec.seed + 10_000, "synthetic"
            spec.prompt_dist = spec.output_dist = "fixed"
            spec.prompt_len, spec.output_len = 32, 8
            self.run(generate(spec, rate=0), "warmup", progress=False)
        if a.prime and a.workload in PREFIX_WORKLOADS:
            primed = priming(spec_from(a, self.model))
            log(f"priming the caches with {len(primed)} shared prefixes")
            self.run(primed, "prime", progress=False)
        return self

    def run(self, requests, label: str, progress: bool = True):
        """run_requests' results, plus the prefix cache hit rates of the run."""
        a = self.a
        before = prefix_stats.snapshot(self.metrics_url, self.replica_metrics_urls)
        out = asyncio.run(run_requests(
            self.address, requests, channels=a.channels, stream_interval=a.stream_interval,
            timeout=a.timeout, metrics_url=self.metrics_url, label=label,
            progress=progress and not a.no_progress))
        after = prefix_stats.snapshot(self.metrics_url, self.replica_metrics_urls)
        return (*out, prefix_stats.between(before, after))

    def __exit__(self, *exc):
        if self.stack:
            self.stack.stop()
            log("stack stopped")


def measured(target: Target, a, model, requests, label: str, slo: M.SLO, out_dir: Path, stem: str):
    """One run: aggregates (with the roofline), CSV and plots; returns (summary, results)."""
    results, scrapes, wall, client_lag, hits = target.run(requests, label)
    summary = M.aggregate(results, wall, slo)
    summary["prefix_cache"] = hits
    if a.workload in PREFIX_WORKLOADS:
        prompt = sum(r.prompt_len for r in requests)
        summary["workload_reusable_prompt_share"] = reusable_tokens(requests, a.system_len) / prompt
    # Client-side latencies include the load generator's own stalls; server-side ones do not.
    summary["client_max_loop_lag_s"] = client_lag
    limit = limit_for(a, model, requests)
    if limit:
        roofline.attach(summary, limit)
    M.write_csv(out_dir / f"{stem}.csv", results)
    M.write_summary_csv(out_dir / f"{stem}-summary.csv", summary)
    plots.cdf_plot(out_dir / f"{stem}-cdf.png", {label: results}, title=label)
    plots.load_plot(out_dir / f"{stem}-load.png", M.inflight_timeline(results), scrapes,
                    title=f"{label}: requests in flight per replica")
    summary["files"] = {"csv": str(out_dir / f"{stem}.csv"), "summary_csv": str(out_dir / f"{stem}-summary.csv"),
                        "cdf_png": str(out_dir / f"{stem}-cdf.png"),
                        "load_png": str(out_dir / f"{stem}-load.png")}
    log(line(label, summary))
    return summary, results


def line(label: str, s: dict) -> str:
    def ms(d, k):
        v = d.get(k)
        return "-" if v is None else f"{v * 1000:.0f}"
    roof = s.get("roofline")
    roof_txt = f", {roof['fraction_of_limit_output_tok_s'] * 100:.1f}% of roofline" if roof else ""
    hits = s.get("prefix_cache") or {}

    def pct(k):
        v = hits.get(k)
        return "-" if v is None else f"{v * 100:.0f}%"
    hit_txt = (f"; prefix hits engine {pct('engine_hit_rate')}, router {pct('router_hit_rate')}, "
               f"oracle {pct('oracle_hit_rate')}") if hits else ""
    return (f"{label}: {s['finished']}/{s['requests']} ok ({s['exact_output_length']} exact), "
            f"{s['throughput_req_s']:.2f} req/s, {s['throughput_output_tok_s']:.0f} out tok/s{roof_txt}; "
            f"TTFT p50/p99 {ms(s['ttft_s'], 'p50')}/{ms(s['ttft_s'], 'p99')} ms, "
            f"TBT p99 {ms(s['tbt_s'], 'p99')} ms, e2e p50/p99 {ms(s['e2e_s'], 'p50')}/{ms(s['e2e_s'], 'p99')} ms, "
            f"sched delay p50 {ms(s['server_scheduling_delay_s'], 'p50')} ms, "
            f"goodput {s['goodput']['share'] * 100 if s['goodput']['share'] is not None else 0:.0f}%, "
            f"client stall max {s.get('client_max_loop_lag_s', 0) * 1000:.0f} ms{hit_txt}")


# ---------------------------------------------------------------- commands
def cmd_run(a) -> int:
    model = resolve_model(a)
    spec, slo = spec_from(a, model), slo_from(a)
    requests = generate(spec)
    out_dir = Path(a.out_dir)
    with Target(a, model=model) as t:
        summary, results = measured(t, a, model, requests, f"{t.policy} {a.name}", slo, out_dir, a.name)
    write_json(Path(a.summary_dir or out_dir) / f"{a.name}.json",
               {"kind": "run", "target": target_desc(a, t.policy), "workload": spec.describe(),
                "summary": summary})
    return 0 if summary["errors"] == 0 else 1


def target_desc(a, policy) -> dict:
    return {"router": a.router, "start_stack": a.start_stack, "policy": policy, "replicas": a.replicas,
            "model": a.model or ("tiny-llama (built offline)" if a.start_stack else None),
            "device": a.device, "scheduler": a.scheduler, "replica_args": a.replica_arg}


def find_capacity(a, target: Target | None, model, spec: WorkloadSpec, slo: M.SLO, out_dir: Path,
                  num_requests: int | None = None, on_probe=None) -> dict:
    """on_probe(partial result) after every probe: a search cut short still leaves its probes.
    target None: each probe starts (and stops) a stack of its own (--cold-probes)."""
    probes = []
    rule = {"tbt_p99_s": slo.tbt_s, "sched_delay_p50_s": slo.sched_delay_p50_s, "keep_up": cap.KEEP_UP,
            "ttft_p99_s": slo.ttft_p99_s}

    def probe(rate: float) -> bool:
        sp = WorkloadSpec(**{**spec.describe(), "num_requests": num_requests or spec.num_requests})
        reqs = generate(sp, rate=rate)
        stem = f"{a.name}-probe-{rate:.3f}"
        with contextlib.nullcontext(target) if target is not None else Target(a, model=model) as t:
            summary, _ = measured(t, a, model, reqs, f"probe {rate:.2f} {spec.rate_unit}", slo, out_dir, stem)
        ok, why = cap.probe_passes(summary, slo.tbt_s, slo.sched_delay_p50_s, offered_rate=rate,
                                   ttft_p99_s=slo.ttft_p99_s)
        log(f"  probe {rate:.3f} {spec.rate_unit}: {'PASS' if ok else 'fail'} ({why})")
        probes.append({"rate": rate, "passed": ok, "why": why, "summary": summary})
        if on_probe:
            passed = [p["rate"] for p in probes if p["passed"]]
            on_probe({"capacity_req_s": max(passed, default=None), "complete": False, "rule": rule,
                      "probes": probes})
        return ok

    best, history = cap.search(probe, a.initial_rate, max_probes=a.max_probes, rel_tol=a.rel_tol,
                               growth=a.growth)
    log(f"capacity: {best} {spec.rate_unit} after {len(history)} probes")
    return {"capacity_req_s": best, "complete": True, "rule": rule, "history": history, "probes": probes}


def cmd_capacity(a) -> int:
    model = resolve_model(a)
    spec, slo = spec_from(a, model), slo_from(a)
    out_dir = Path(a.out_dir)
    summary_dir = Path(a.summary_dir or out_dir)

    def save(result: dict) -> None:
        write_json(summary_dir / f"{a.name}.json",
                   {"kind": "capacity", "target": target_desc(a, a.policy), "workload": spec.describe(), **result})
        plots.capacity_plot(summary_dir / f"{a.name}-capacity.png", {a.name: result}, slo.tbt_s,
                            cap.KEEP_UP, title=f"capacity search: {a.name}")

    if a.cold_probes:
        if not a.start_stack:
            raise SystemExit("--cold-probes starts a stack for every probe: give --start-stack")
        result = find_capacity(a, None, model, spec, slo, out_dir, on_probe=save)
    else:
        with Target(a, model=model) as t:
            result = find_capacity(a, t, model, spec, slo, out_dir, on_probe=save)
    save(result)
    return 0 if result["capacity_req_s"] else 1


def cmd_compare(a) -> int:
    model = resolve_model(a)
    spec, slo = spec_from(a, model), slo_from(a)
    out_dir, summary_dir = Path(a.out_dir), Path(a.summary_dir or a.out_dir)
    capacity_result = None
    runs: dict[float, dict[str, list]] = {}
    summaries: dict[str, dict[str, dict]] = {}
    rates = a.rates
    for i, policy in enumerate(a.policies):
        with Target(a, policy=policy, model=model) as t:
            if rates is None:
                if a.capacity is None and a.find_capacity and capacity_result is None:
                    capacity_result = find_capacity(a, t, model, spec, slo, out_dir, a.capacity_requests)
                    a.capacity = capacity_result["capacity_req_s"]
                    if not a.capacity:
                        raise SystemExit("no passing rate found; lower --initial-rate")
                if a.capacity is None:
                    raise SystemExit("give --rates, --capacity or --find-capacity")
                rates = [a.capacity * f for f in a.loads]
            for j, rate in enumerate(rates):
                key = f"{a.loads[j] * 100:.0f}%" if a.rates is None else f"{rate:g} {spec.rate_unit}"
                stem = f"{a.name}-{policy}-{key.replace('%', 'pct').replace(' ', '').replace('/', '')}"
                reqs = generate(spec, rate=rate)
                summary, results = measured(t, a, model, reqs, f"{policy} @ {key} ({rate:.2f} {spec.rate_unit})",
                                            slo, out_dir, stem)
                summary["rate_req_s"] = rate
                summaries.setdefault(key, {})[policy] = summary
                runs.setdefault(key, {})[policy] = results
    pngs = {}
    for key, by_policy in runs.items():
        safe = key.replace("%", "pct").replace(" ", "").replace("/", "")
        pngs[key] = str(plots.cdf_plot(summary_dir / f"{a.name}-{safe}-cdf.png", by_policy,
                                       metrics=("ttft", "tbt", "e2e"), title=f"load {key}"))
    bars = [(f"{k} {m}", {p: s[f"{m.split()[0]}_s"]["p99" if "p99" in m else "p50"] for p, s in v.items()})
            for k, v in summaries.items() for m in ("ttft p50", "ttft p99")]
    pngs["ttft_bars"] = str(plots.bar_plot(summary_dir / f"{a.name}-ttft.png", bars, "TTFT (s)",
                                           "TTFT per policy and load"))
    table = {k: {p: {"rate_req_s": s["rate_req_s"], "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
                     "server_ttft_p99_s": s["server_ttft_s"]["p99"],
                     "e2e_p50_s": s["e2e_s"]["p50"], "e2e_p99_s": s["e2e_s"]["p99"], "tbt_p99_s": s["tbt_s"]["p99"],
                     "throughput_req_s": s["throughput_req_s"], "goodput_share": s["goodput"]["share"],
                     "errors": s["errors"], "requests_per_replica": s["requests_per_replica"],
                     "fraction_of_roofline_output_tok_s": (s.get("roofline") or {}).get("fraction_of_limit_output_tok_s"),
                     **_hit_rates(s)}
                 for p, s in v.items()} for k, v in summaries.items()}
    if any(row.get("engine_hit_rate") is not None for v in table.values() for row in v.values()):
        hit_bars = [(f"{k} {m}", {p: row[f"{m}_hit_rate"] or 0 for p, row in v.items()})
                    for k, v in table.items() for m in ("engine", "oracle")]
        pngs["hit_bars"] = str(plots.bar_plot(summary_dir / f"{a.name}-hits.png", hit_bars,
                                              "prefix cache hit rate", "hit rate per policy and load"))
    target = None
    if "pull" in a.policies and "round_robin" in a.policies:
        target = {}
        for k, v in summaries.items():
            pull, rr = v["pull"]["ttft_s"]["p99"], v["round_robin"]["ttft_s"]["p99"]
            # The router's own TTFT (accept to first token sent) too: on a small shared
            # machine the client's TTFT also holds the load generator's own stalls.
            spull, srr = v["pull"]["server_ttft_s"]["p99"], v["round_robin"]["server_ttft_s"]["p99"]
            target[k] = {"pull_ttft_p99_s": pull, "round_robin_ttft_p99_s": rr,
                         "ratio": pull / rr if pull and rr else None,
                         "pull_at_most_half": bool(pull and rr and pull <= 0.5 * rr),
                         "server_pull_ttft_p99_s": spull, "server_round_robin_ttft_p99_s": srr,
                         "server_ratio": spull / srr if spull and srr else None}
    for k, v in table.items():
        for p, row in v.items():
            hit = row.get("engine_hit_rate")
            log(f"{k:>8} {p:<18} TTFT p50 {row['ttft_p50_s']:.3f} p99 {row['ttft_p99_s']:.3f} "
                f"(server p99 {row['server_ttft_p99_s'] or 0:.3f})  "
                f"e2e p50 {row['e2e_p50_s']:.3f} p99 {row['e2e_p99_s']:.3f}  ({row['throughput_req_s']:.2f} req/s)"
                + (f"  hits {hit * 100:.0f}%" if hit is not None else ""))
    if target:
        log(f"pull p99 TTFT <= 1/2 round_robin: {json.dumps(target)}")
    write_json(summary_dir / f"{a.name}.json",
               {"kind": "compare", "target": target_desc(a, None), "workload": spec.describe(),
                "slo": slo.__dict__, "capacity": capacity_result and {k: v for k, v in capacity_result.items()},
                "capacity_req_s": a.capacity, "table": table, "pull_vs_round_robin": target, "plots": pngs,
                "runs": summaries})
    return 0


def _hit_rates(summary: dict) -> dict:
    hits = summary.get("prefix_cache") or {}
    return {f"{k}_hit_rate": hits.get(f"{k}_hit_rate") for k in ("engine", "router", "oracle")}


def cmd_roofline(a) -> int:
    model = resolve_model(a)
    reqs = generate(spec_from(a, model))
    limit = limit_for(a, model, reqs)
    print(json.dumps(limit, indent=2))
    return 0


# Config-only model shapes (the replica loads --load-format dummy). cpu-small is a
# CPU shape whose prefill costs what a served model's does relative to a decode
# step (a 768-token prefill ~12 batch-8 decode steps, as 4096 tokens are for the 8B
# on an H200), unlike the tiny test model, whose steps are mostly fixed overhead.
MODEL_SHAPES = {
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, torch_dtype="bfloat16",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "cpu-small": dict(
        vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        rope_theta=10000.0, torch_dtype="float32"),
}


def cmd_model_dir(a) -> int:
    """A model's config with the tiny model's tokenizer: the replica loads dummy
    weights (--load-format dummy) and prompts are token ids, so no download is needed."""
    import shutil

    import transformers

    from stack.__main__ import default_model

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    transformers.LlamaConfig(tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
                             **MODEL_SHAPES[a.shape]).save_pretrained(str(out))
    tiny = Path(default_model())
    for f in tiny.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    print(out)
    return 0


def cmd_plot_capacity(a) -> int:
    searches, slos = {}, set()
    for item in a.results:
        label, _, path = item.rpartition("=") if "=" in item else ("", "", item)
        result = json.loads(Path(path).read_text())
        if "probes" not in result or "rule" not in result:
            raise SystemExit(f"{path} is not a capacity search result (no probes or no rule)")
        searches[label or Path(path).stem] = result
        slos.add((result["rule"]["tbt_p99_s"], result["rule"].get("keep_up", cap.KEEP_UP)))
    if len(slos) > 1:
        raise SystemExit(f"the searches used different rules (TBT SLO, keep-up) {sorted(slos)}; plot them apart")
    tbt_slo, keep_up = slos.pop()
    for label, result in searches.items():
        unit = rate_unit(result.get("workload", {}).get("workload"))
        print(f"{label}: capacity {result['capacity_req_s']} {unit}")
        for p in sorted(result["probes"], key=lambda p: p["rate"]):
            print("  " + probe_row(p, unit))
    print(plots.capacity_plot(Path(a.out), searches, tbt_slo, keep_up, title=a.title))
    return 0


def probe_row(probe: dict, unit: str = "req/s") -> str:
    """One probe in a line. In flight is Little's law over the arrival window: the
    admitted rate times the mean time a request stays (the router's e2e), i.e. how
    many requests the replicas held on average, to set against their seats."""
    s = probe["summary"]
    admitted, offered, e2e = s.get("admitted_req_s"), s.get("offered_req_s"), s["server_e2e_s"]["mean"]
    in_flight = f"{admitted * e2e:.0f}" if admitted and e2e else "-"
    share = f"{admitted / offered:.2f}" if admitted and offered else "-"
    return (f"{probe['rate']:7.3f} {unit} {'pass' if probe['passed'] else 'FAIL'}  "
            f"p99 TBT {s['tbt_s']['p99'] * 1000:5.1f} ms  admitted/offered {share}  "
            f"mean e2e {e2e or 0:5.1f} s  in flight {in_flight}")


def main(argv=None) -> int:
    a = parse_args(argv)
    return {"run": cmd_run, "capacity": cmd_capacity, "compare": cmd_compare,
            "roofline": cmd_roofline, "model-dir": cmd_model_dir,
            "plot-capacity": cmd_plot_capacity,
            "repeats": lambda a: repeats.main(a.out, a.results, a.title),
            "prefix-report": lambda a: prefix_report.main(a.runs, a.out)}[a.cmd](a)
