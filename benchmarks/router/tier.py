"""A tier of routers on one Redis in front of many simulated replicas: the
request rate 1, 2 and 4 routers sustain with 64-token streams and the latency
they add, and what killing one router under load costs.

Everything is a separate process: Redis, each router, the simulated replicas
(`python -m replica_worker.sim -k PER_PROCESS`, each process dialling the
routers in its own rotation, so replica streams spread over the routers) and
the load generator (benchmarks/router/tier_load.py: open-loop Poisson
arrivals, FailoverStream over all routers, request i starting at router i mod N).

    python -m benchmarks.router.tier                          # 1, 2, 4 routers x 64 replicas
    python -m benchmarks.router.tier --routers 1 2 --replicas 8 --per-process 4 \
        --rates 20 40 --duration 3 --failover-routers 2 --out /tmp/tier.json   # a small check

Per router count, rates are offered in turn until one is not sustained (a
request lost, a backlog left at the end, or p99 added TTFT over
--added-limit-ms; tier_report.DEFINITIONS). Failover (--failover-routers N, default 4): N routers at
--failover-load of the highest rate N sustained (or --failover-rate), one run
per share given; one router is SIGKILLed a third of the way in. Definitions are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.router.local_router import cpu_seconds
from benchmarks.router.overhead import ROOT, scrape, warm_up
from benchmarks.router.tier_report import DEFINITIONS, failover_summary, rate_summary
from common.redis_server import RedisServer, free_port


class Tier:
    """Redis, n routers and the simulated replicas, as processes."""

    def __init__(self, args, work: Path, model: Path, n: int):
        self.args, self.work, self.model, self.n = args, work, model, n
        self.redis = RedisServer(work / f"redis-{n}-{time.monotonic_ns()}")
        self.log = open(work / f"tier-{n}.log", "ab")
        self.ports = [free_port() for _ in range(n)]
        self.metrics_ports = [free_port() for _ in range(n)]
        self.routers: list[subprocess.Popen] = []
        self.sims: list[subprocess.Popen] = []

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def start(self) -> "Tier":
        a = self.args
        self.redis.start()
        for port, mport in zip(self.ports, self.metrics_ports):
            self.routers.append(self._spawn(
                ["-m", "router", "--port", str(port), "--host", "127.0.0.1", "--redis-url",
                 self.redis.url, "--model", str(self.model), "--metrics-port", str(mport),
                 "--heartbeat-interval", "0.5", "--lease-ttl", "10",
                 "--queue-limit", "100000", "--log-level", "WARNING"],
                cwd=a.router_tree or ROOT, env=dict(os.environ, **router_env(a))))
        processes = max(1, a.replicas // a.per_process)
        for i in range(processes):
            order = self.addresses[i % self.n:] + self.addresses[:i % self.n]
            self.sims.append(self._spawn(
                ["-m", "replica_worker.sim", "--router", ",".join(order), "--model", str(self.model),
                 "--profile", a.profile, "--replica-id", f"sim{i}", "-k", str(a.per_process),
                 "--max-num-seqs", str(a.max_num_seqs), "--drain-timeout", "2"]))
        self._wait_for_replicas(processes * a.per_process)
        # A router loads its tokenizer (transformers) on a thread after it starts,
        # and the import holds the GIL for seconds; a text prompt waits for it, so
        # no measured run overlaps it.
        for address in self.addresses:
            warm_up(address)
        return self

    def _spawn(self, argv: list[str], cwd: Path = ROOT, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *argv], cwd=cwd, stdout=self.log,
                                stderr=subprocess.STDOUT, env=env)

    def replicas_connected(self) -> int:
        total = 0
        for proc, mport in zip(self.routers, self.metrics_ports):
            if proc.poll() is None:
                try:
                    total += int(scrape(mport).get("quadriga_replicas_connected", 0))
                except OSError:
                    pass
        return total

    def _wait_for_replicas(self, want: int) -> None:
        deadline = time.monotonic() + 180
        while self.replicas_connected() < want:
            if any(p.poll() is not None for p in self.routers + self.sims):
                raise SystemExit(f"a process exited early; see {self.log.name}")
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.replicas_connected()} of {want} replicas connected; "
                                 f"see {self.log.name}")
            time.sleep(0.3)

    def _cpu(self) -> dict:
        """CPU seconds so far of Redis, each live router and all simulated replicas."""
        def of(proc) -> float:
            try:
                return cpu_seconds(proc.pid) if proc is not None and proc.poll() is None else 0.0
            except OSError:   # exited meanwhile
                return 0.0
        return dict(redis=of(self.redis.proc), routers=[of(p) for p in self.routers],
                    sims=[of(p) for p in self.sims])

    _COUNTED = ("quadriga_messages_in_total", "quadriga_messages_out_total",
                "quadriga_client_messages_total", "quadriga_redis_round_trips_total")

    def _counts(self) -> list[dict | None]:
        """Each live router's message and Redis round-trip totals (None: gone)."""
        out = []
        for proc, mport in zip(self.routers, self.metrics_ports):
            try:
                totals = scrape(mport) if proc.poll() is None else None
            except OSError:
                totals = None
            out.append(None if totals is None else {k: totals.get(k, 0.0) for k in self._COUNTED})
        return out

    def load(self, rate: float, duration: float, seed: int, kill_at: float | None = None) -> dict:
        """One open-loop run, split over --clients load generator processes;
        with kill_at, router 1 is SIGKILLed that many seconds in. Also the cores
        each server process kept busy meanwhile (cores_busy), so what binds shows."""
        a, k = self.args, self.args.clients
        cpu_before, wall_before, counts_before = self._cpu(), time.monotonic(), self._counts()
        outs = [self.work / f"load-{seed}-{i}.json" for i in range(k)]
        gens = [subprocess.Popen(
            [sys.executable, "-m", "benchmarks.router.tier_load", "--routers", ",".join(self.addresses),
             "--rate", str(rate / k), "--duration", str(duration), "--vocab", str(a.vocab),
             "--output-tokens", str(a.output_tokens), "--stream-interval", str(a.stream_interval),
             "--seed", str(seed * 100 + i), "--first-index", str(i * 10_000_000),
             "--out", str(outs[i])],
            cwd=ROOT, stdout=self.log, stderr=self.log) for i in range(k)]
        kill_wall = None
        if kill_at is not None:
            time.sleep(kill_at)
            kill_wall = time.time()
            self.routers[1 % self.n].send_signal(signal.SIGKILL)
        runs = []
        for gen, path in zip(gens, outs):
            if gen.wait() != 0:
                raise SystemExit(f"load generator failed; see {self.log.name}")
            runs.append(json.loads(path.read_text()))
            path.unlink()
        # Each generator's times count from its own start (after its imports, which
        # take a second or so): one time base, that of the first to start, and the
        # kill on it too.
        t0 = min(r["start_wall"] for r in runs)
        records = []
        for r in runs:
            shift = r["start_wall"] - t0
            for rec in r["records"]:
                rec["sent"] += shift
                rec["attempts"] = [(i, s + shift, e + shift, c) for i, s, e, c in rec.get("attempts", ())]
            records += r["records"]
        killed = None if kill_wall is None else kill_wall - t0
        cpu_after, wall = self._cpu(), time.monotonic() - wall_before
        cores = dict(redis=(cpu_after["redis"] - cpu_before["redis"]) / wall,
                     routers=[(after - before) / wall if after else None   # None: killed
                              for before, after in zip(cpu_before["routers"], cpu_after["routers"])],
                     sims=sum(cpu_after["sims"]) / wall - sum(cpu_before["sims"]) / wall,
                     busiest_sim=max(after - before for before, after in
                                     zip(cpu_before["sims"], cpu_after["sims"])) / wall,
                     clients=[r["cpu_s"] / r["elapsed_s"] for r in runs])
        return dict(offered_rps=rate, records=records, killed_at_s=killed, cores_busy=cores,
                    per_request=self._per_request(counts_before, len(records)))

    def _per_request(self, before: list, requests: int) -> dict:
        """Messages and Redis round trips a request over the routers that lived
        through the run: what a router's time goes to (replica streams' steps
        in, Assigns and Acks out, client stream messages)."""
        sums = dict.fromkeys(self._COUNTED, 0.0)
        for b, a in zip(before, self._counts()):
            if b is not None and a is not None:
                for k in sums:
                    sums[k] += a[k] - b[k]
        n = max(1, requests)
        return dict(replica_messages_in=sums["quadriga_messages_in_total"] / n,
                    replica_messages_out=sums["quadriga_messages_out_total"] / n,
                    client_messages=sums["quadriga_client_messages_total"] / n,
                    redis_round_trips=sums["quadriga_redis_round_trips_total"] / n)

    def stop(self) -> None:
        for proc in self.sims + self.routers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.redis.stop()
        self.log.close()


def router_env(args) -> dict:
    """--router-env KEY=VALUE settings, as the routers' environment adds them."""
    return dict(kv.split("=", 1) for kv in (getattr(args, "router_env", None) or []))


def ladder_rates(args, n: int) -> list[float]:
    """The rates offered to n routers: --rates as given, or times n with
    --rates-per-router, so every count climbs in the same relative steps."""
    return [r * n for r in args.rates] if args.rates_per_router else list(args.rates)


def ladder(args, work, model, n: int) -> dict:
    tier = Tier(args, work, model, n).start()
    rows = []
    rates = ladder_rates(args, n)
    try:
        tier.load(min(rates), 3.0, seed=999)   # warm-up: channels, first steps
        for k, rate in enumerate(rates):
            result = tier.load(rate, args.duration, seed=k + 1)
            row = rate_summary(result, args.added_limit_ms)
            row["cores_busy"] = cores = result["cores_busy"]
            row["per_request"] = result["per_request"]
            rows.append(row)
            print(f"{n} routers  offered {rate:6.0f}/s  completed {row['completed_rps']:7.1f}/s  "
                  f"lost {row['lost']}  ttft p50 {row['ttft_p50_ms']:7.1f} p99 {row['ttft_p99_ms']:7.1f} ms  "
                  f"added p50 {row['added_ttft_p50_ms']:6.1f} p99 {row['added_ttft_p99_ms']:7.1f} ms  "
                  f"cores: redis {cores['redis']:.2f}, busiest router "
                  f"{max(c for c in cores['routers'] if c is not None):.2f}, busiest sim process "
                  f"{cores['busiest_sim']:.2f}, busiest load generator {max(cores['clients']):.2f}; "
                  f"a request: {row['per_request']['replica_messages_in']:.1f} replica messages in, "
                  f"{row['per_request']['client_messages']:.1f} client messages"
                  f"{'' if row['sustained'] else '  (not sustained)'}", flush=True)
            if not row["sustained"]:
                break
    finally:
        tier.stop()
    sustained = [r for r in rows if r["sustained"]]
    best = max(sustained, key=lambda r: r["offered_rps"]) if sustained else None
    return dict(routers=n, replicas=args.replicas, rows=rows,
                sustained_rps=best["completed_rps"] if best else 0.0,
                sustained_offered_rps=best["offered_rps"] if best else 0.0,
                added_ttft_p50_ms=best["added_ttft_p50_ms"] if best else None,
                added_ttft_p99_ms=best["added_ttft_p99_ms"] if best else None)


def failover(args, work, model, rate: float, share: float | None = None, records: str | None = None) -> dict:
    n = args.failover_routers
    tier = Tier(args, work, model, n).start()
    try:
        tier.load(min(ladder_rates(args, n)), 3.0, seed=999)
        duration = args.failover_duration
        result = tier.load(rate, duration, seed=77, kill_at=duration / 3)
    finally:
        tier.stop()
    summary = failover_summary(result, args.window_s)
    summary.update(routers=n, replicas=args.replicas, offered_rps=rate, duration_s=duration,
                   share_of_sustained=share, cores_busy=result["cores_busy"],
                   per_request=result["per_request"])
    if records:   # every request, with its attempts (router index, start, end, status)
        Path(records).write_text(json.dumps(dict(addresses=tier.addresses, **result)))
    back = (f"p99 TTFT back to normal after {summary['recovery_s']} s"
            if summary["recovered_within_run"] else
            f"p99 TTFT not back to normal by the end of the run ({summary['recovery_s']} s after the kill)")
    print(f"failover: {n} routers at {rate:.0f}/s, router 1 killed at {summary['killed_at_s']:.1f} s: lost "
          f"{summary['lost']}, duplicated tokens {summary['duplicated_tokens']}, {back}", flush=True)
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--routers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--per-process", type=int, default=16, help="simulated replicas per process")
    p.add_argument("--profile", default="h200-8b")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--rates", type=float, nargs="+", default=[250, 500, 1000, 1500, 2000, 3000])
    p.add_argument("--rates-per-router", action="store_true",
                   help="--rates are per router: n routers are offered n times each")
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--clients", type=int, default=1, help="load generator processes")
    p.add_argument("--added-limit-ms", type=float, default=500.0)
    p.add_argument("--failover-routers", type=int, default=4, help="0: no failover run")
    p.add_argument("--failover-load", type=float, nargs="+", default=[0.7],
                   help="one failover run per share of what --failover-routers sustained")
    p.add_argument("--failover-rate", type=float, nargs="+", help="instead of --failover-load x sustained")
    p.add_argument("--failover-duration", type=float, default=15.0)
    p.add_argument("--window-s", type=float, default=0.5, help="TTFT p99 windows (failover)")
    p.add_argument("--records", help="failover: the raw records (JSON) too")
    p.add_argument("--router-env", action="append", default=[], metavar="KEY=VALUE",
                   help="added to the routers' environment (e.g. QUADRIGA_ROUTER_REDIS_STEP_LINGER_MS=2)")
    p.add_argument("--router-tree", help="run the routers of this tree (a checkout or `git archive` "
                                         "of another commit); the rest from this one")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/router_tier.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from common.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="router-tier-"))
    model = build_tiny_model(work / "model")
    args.vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tiers = [ladder(args, work, model, n) for n in args.routers]
    result = dict(command=" ".join(shlex.quote(a) for a in
                                   [sys.executable, "-m", "benchmarks.router.tier", *(argv or sys.argv[1:])]),
                  definitions=DEFINITIONS, settings={k: v for k, v in vars(args).items() if k != "out"},
                  tiers=tiers)
    if args.failover_routers:
        runs_of = [(rate, None) for rate in args.failover_rate or ()]
        if not runs_of:
            same = [t for t in tiers if t["routers"] == args.failover_routers]
            base = same[0]["sustained_offered_rps"] if same else max(t["sustained_offered_rps"] for t in tiers)
            base = base or min(ladder_rates(args, args.failover_routers))
            runs_of = [(load * base, load) for load in args.failover_load]
        runs = [failover(args, work, model, rate, share,
                         records=args.records and (args.records if k == 0 else f"{args.records}.{k}"))
                for k, (rate, share) in enumerate(runs_of)]
        result["failover"] = runs[0]
        if len(runs) > 1:   # "failover" keeps the first run, as with one
            result["failover_runs"] = runs
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}; logs in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
