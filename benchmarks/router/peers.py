"""Quadriga's OpenAI HTTP path beside two peer routers, one run, one machine.

Targets, all up at once and measured interleaved (the order rotates each repeat):
  direct          wrk straight to the mock backend (the baseline)
  sglang-router   sglang-router -> mock backend
  vllm-router     vllm-router -> mock backend
  quadriga-http   Quadriga's router, --http-port, real Redis, scripted replicas that
                  answer at once (one token per step, so 64 tokens are 64 steps)
  quadriga-grpc   (--grpc) the same router's gRPC Generate, driven by a Python
                  closed-loop client (grpc_closed_loop.py), not wrk

One load generator for the HTTP targets: wrk with completions.lua, POST
/v1/completions (non-streaming), the same body, threads, connections and
duration for every target. "Added" latency is through the router minus
straight to the mock in the same repeat; for Quadriga too, although its
replicas are not the mock (both answer at once).

The peers need their own environment (never the project's venv), made once:
    python3 -m venv /tmp/quadriga-peers && /tmp/quadriga-peers/bin/pip install \\
        sglang-router==0.3.2 vllm-router==0.1.17
and wrk (apt-get install -y wrk). Offline, benchmarks/router/prepare-peers-carry.sh
packs both and the router's own dependencies (see its header).

    flock /tmp/quadriga-bench.lock .venv/bin/python -m benchmarks.router.peers --grpc \\
        --profile-dir /tmp/peers-profile
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.router import peer_routers as peers  # noqa: E402
from benchmarks.router.local_router import LocalRouter, cpu_seconds, project_env  # noqa: E402
from benchmarks.router.mock_openai_backend import MODEL  # noqa: E402
from benchmarks.router.peers_report import environment, print_table, summarize  # noqa: E402
from benchmarks.router.profile_top import top_frames  # noqa: E402
from benchmarks.router.wrk_runner import WrkSettings, find_wrk, run_wrk, wrk_version  # noqa: E402
from common.redis_server import free_port  # noqa: E402

# Words the tiny model's tokenizer knows, 16 of them; no quotes or escapes.
PROMPT = ("the model token cache block queue router replica request stream "
          "prefill decode chunk batch latency serving")

DEFINITIONS = {
    "p50_ms, p99_ms": "wrk's latency percentiles of one run: request written -> whole answer read",
    "added_p50_ms, added_p99_ms": "per repeat: the target's percentile minus the direct-to-mock "
                                  "percentile of the same setting in the same repeat; for "
                                  "quadriga-* too (its scripted replicas stand where the mock stands)",
    "requests_per_s": "completed requests / wrk's measured duration (closed loop: what the target "
                      "sustains at that concurrency)",
    "cpu_ms_per_request": "the router process's user+sys CPU during the run / completed requests",
    "mock_cpu_ms_per_request": "the same of the backend: the mock behind direct and the peers; "
                               "Quadriga's scripted replicas, all of them",
    "redis_cpu_ms_per_request": "the same of Quadriga's Redis server",
    "spread": "median over repeats, with min and max",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env = p.add_mutually_exclusive_group()
    env.add_argument("--peers-venv", default="/tmp/quadriga-peers",
                     help="virtual environment holding the peers (DIR/bin/python)")
    env.add_argument("--peers-site", help="a `pip install --target` folder holding the peers; "
                                          "run with this interpreter")
    p.add_argument("--wrk", help="wrk binary (default: wrk on PATH)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, nargs="+", default=[1, 64])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=int, default=6, help="seconds per measured run")
    p.add_argument("--warmup", type=int, default=1, help="seconds of the same load first, unmeasured")
    p.add_argument("--wrk-threads", type=int, default=2, help="at most one per connection")
    p.add_argument("--mock-workers", type=int, default=1,
                   help="mock backend processes sharing its port (more on a many-core box)")
    p.add_argument("--replicas", type=int, default=2, help="Quadriga's scripted replicas")
    p.add_argument("--only", nargs="+", help="measure only these targets (direct is always measured)")
    p.add_argument("--grpc", action="store_true", help="also Quadriga's gRPC path (Python client)")
    p.add_argument("--router-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for Quadriga's router only (its QUADRIGA_* settings, say)")
    p.add_argument("--profile-dir", help="after the measurements, py-spy record Quadriga's router "
                                         "under wrk at the highest concurrency, one file per max_tokens")
    p.add_argument("--profile-duration", type=int, default=8)
    p.add_argument("--profile-native", action="store_true",
                   help="with --profile-dir: C frames too (uvloop, gRPC core)")
    p.add_argument("--machine-note", default="shared with other users' processes while measured; "
                                             "the load average is recorded before and after")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/router_peers.json"))
    return p.parse_args(argv)


class Targets:
    """Starts every target, checks each answers a real completion, and stops them.
    A target that cannot be started is recorded with the reason, not measured."""

    def __init__(self, args, work: Path):
        self.args = args
        self.work = work
        self.log = open(work / "targets.log", "w")
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.quadriga: LocalRouter | None = None
        self.peer_env: peers.PeerEnv | None = None

    def wanted(self, name: str) -> bool:
        return name == "direct" or not self.args.only or name in self.args.only

    def __enter__(self) -> "Targets":
        try:
            self._start_all()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
        if self.quadriga is not None:
            self.quadriga.stop()
        self.log.close()

    def _start_all(self) -> None:
        a = self.args
        mock_port = free_port()
        self.procs["direct"] = peers.start_mock(mock_port, a.mock_workers, self.log)
        self.urls["direct"] = f"http://127.0.0.1:{mock_port}"
        self._ready("direct")
        try:
            self.peer_env = peers.PeerEnv.from_args(a.peers_venv, a.peers_site)
        except SystemExit as exc:
            for kind in peers.PEERS:
                self.failed[kind.name] = str(exc)
        for kind in peers.PEERS:
            if self.wanted(kind.name) and kind.name not in self.failed:
                port = free_port()
                self.procs[kind.name] = peers.start_peer(kind, self.peer_env, port,
                                                         self.urls["direct"], self.log)
                self.urls[kind.name] = f"http://127.0.0.1:{port}"
        if self.wanted("quadriga-http") or a.grpc:
            env = dict(kv.split("=", 1) for kv in a.router_env)
            self.quadriga = LocalRouter(self.work / "quadriga", replicas=a.replicas, http=True,
                                        model_name=MODEL, router_env=env).__enter__()
            self.urls["quadriga-http"] = f"http://127.0.0.1:{self.quadriga.http_port}"
        for name in list(self.urls):
            if name != "direct":
                self._ready(name)

    def _ready(self, name: str) -> None:
        proc = self.procs.get(name) or self.quadriga.router
        try:
            peers.wait_until_serving(self.urls[name], proc, MODEL, PROMPT)
            for n in self.args.max_tokens:
                problem = peers.check_completion(
                    peers.post_completion(self.urls[name], MODEL, PROMPT, n), n)
                if problem:
                    raise RuntimeError(problem)
            if name == "quadriga-http":
                # Answered once the router has loaded transformers' tokenizer for the
                # chat template, which it starts at once in the background: on a slow
                # box that import ran on for 10 s and more, into the measurement.
                peers.post_chat(self.urls[name], MODEL, PROMPT, 1, timeout=180)
        except (RuntimeError, OSError, ValueError) as exc:
            if name == "direct":
                raise SystemExit(f"the mock backend does not serve: {exc}; see {self.log.name}")
            self.failed[name] = f"{exc} (log: {self.log.name})"
            self.urls.pop(name)

    def pid(self, name: str) -> int:
        if name.startswith("quadriga"):
            return self.quadriga.router.pid
        return self.procs[name].pid

    def names(self) -> list[str]:
        names = list(self.urls)
        if self.args.grpc and self.quadriga is not None:
            names.append("quadriga-grpc")
        return names


def run_grpc(address: str, s: WrkSettings) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.router.grpc_closed_loop", "--address", address,
           "-c", str(s.concurrency), "--max-tokens", str(s.max_tokens), "-d", str(s.duration_s),
           "--prompt", s.prompt]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=project_env(),
                         timeout=s.duration_s + 60)
    if out.returncode != 0:
        raise RuntimeError(f"gRPC client failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(t: Targets, name: str, s: WrkSettings, wrk: str) -> dict:
    if name == "quadriga-grpc":
        run = lambda st: run_grpc(t.quadriga.grpc_address, st)  # noqa: E731
    else:
        run = lambda st: run_wrk(wrk, t.urls[name], st)  # noqa: E731
    if t.args.warmup > 0:
        run(WrkSettings(**{**s.__dict__, "duration_s": t.args.warmup}))
    # What else the box spends on a request: a peer's mock backend; Quadriga's
    # scripted replicas (they stand where the mock stands) and its Redis.
    companions = {"mock": [t.procs["direct"].pid]}
    if name.startswith("quadriga"):
        companions = {"mock": t.quadriga.replica_pids, "redis": [t.quadriga.redis.proc.pid]}
    pid = t.pid(name)
    cpu0 = cpu_seconds(pid)
    before = {k: sum(map(cpu_seconds, pids)) for k, pids in companions.items()}
    row = run(s)
    per_request = lambda seconds: seconds / max(1, row["requests"]) * 1e3  # noqa: E731
    row["cpu_ms_per_request"] = per_request(cpu_seconds(pid) - cpu0)
    for k, pids in companions.items():
        row[f"{k}_cpu_ms_per_request"] = per_request(sum(map(cpu_seconds, pids)) - before[k])
    return row


def settings_grid(a) -> list[WrkSettings]:
    return [WrkSettings(concurrency=c, max_tokens=n, duration_s=a.duration, threads=a.wrk_threads,
                        model=MODEL, prompt=PROMPT)
            for c in a.concurrency for n in a.max_tokens]


def measure_all(t: Targets, wrk: str) -> list[dict]:
    raw = []
    names = t.names()
    grid = settings_grid(t.args)
    for rep in range(t.args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for s in grid:
            for name in order:
                row = measure(t, name, s, wrk)
                raw.append({"target": name, "repeat": rep, "concurrency": s.concurrency,
                            "max_tokens": s.max_tokens, "threads": row.get("threads"), **row})
                print(f"rep {rep} c={s.concurrency:<3} n={s.max_tokens:<3} {name:14s} "
                      f"p50 {row['latency_us']['percentiles']['50'] / 1e3:7.3f} ms  "
                      f"p99 {row['latency_us']['percentiles']['99'] / 1e3:7.3f} ms  "
                      f"{row['requests_per_s']:8.1f} req/s  cpu/req {row['cpu_ms_per_request']:.3f} ms  "
                      f"errors {row['error_count']}", flush=True)
    return raw


def find_py_spy() -> str:
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("no py-spy beside this interpreter or on PATH (pip install py-spy)")
    return found


def profile(t: Targets, wrk: str, spy_bin: str) -> dict:
    """py-spy on Quadriga's router while wrk drives its HTTP door at the highest
    concurrency; a separate phase, so sampling never touches a measurement."""
    a = t.args
    out_dir = Path(a.profile_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {}
    for n in a.max_tokens:
        c = max(a.concurrency)
        path = out_dir / f"quadriga-http-c{c}-n{n}.txt"
        s = WrkSettings(concurrency=c, max_tokens=n, duration_s=a.profile_duration,
                        threads=a.wrk_threads, model=MODEL, prompt=PROMPT)
        spy = subprocess.Popen([spy_bin, "record", "-p", str(t.quadriga.router.pid), "-r", "200",
                                "-f", "raw", "-o", str(path), "-d", str(a.profile_duration + 1),
                                "--threads", *(["--native"] if a.profile_native else [])],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        row = run_wrk(wrk, t.urls["quadriga-http"], s)
        spy.wait()
        result[f"c{c}_n{n}"] = {"file": str(path), "requests_per_s_while_sampled": row["requests_per_s"],
                                **top_frames(str(path), 30, thread="MainThread")}
    return result


def main(argv=None) -> int:
    a = parse_args(argv)
    wrk = find_wrk(a.wrk)
    spy_bin = find_py_spy() if a.profile_dir else None
    work = Path(tempfile.mkdtemp(prefix="router-peers-"))
    load_before = os.getloadavg()
    with Targets(a, work) as t:
        for name, why in t.failed.items():
            print(f"{name}: not measured: {why}", file=sys.stderr)
        raw = measure_all(t, wrk)
        prof = profile(t, wrk, spy_bin) if a.profile_dir and "quadriga-http" in t.urls else None
        env = environment(a, wrk_version(wrk), t.peer_env, load_before, os.getloadavg())
        failed = dict(t.failed)
    summary, checks = summarize(raw)
    result = {
        "command": " ".join(shlex.quote(x) for x in [
            "flock", "/tmp/quadriga-bench.lock", ".venv/bin/python", "-m",
            "benchmarks.router.peers", *(argv if argv is not None else sys.argv[1:])]),
        **env,
        "workload": {"endpoint": "POST /v1/completions, non-streaming", "prompt": PROMPT,
                     "model": MODEL, "temperature": 0, "concurrency": a.concurrency,
                     "max_tokens": a.max_tokens, "duration_s": a.duration, "warmup_s": a.warmup,
                     "repeats": a.repeats, "wrk_threads": a.wrk_threads,
                     "mock_workers": a.mock_workers, "quadriga_replicas": a.replicas},
        "definitions": DEFINITIONS,
        "not_measured": failed,
        "summary": summary,
        "targets_check": checks,
        "profile": prof,
        "raw": raw,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(summary, checks)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
