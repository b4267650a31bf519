"""Where a request's Redis time goes: one router tree under the overhead
benchmark's load (scripted replicas, 1-token requests), every command Redis
runs logged (SLOWLOG, threshold 0), summed per script. Also prints the last
TRACE line of the router's log, if an instrumented tree wrote one.

    python3 benchmarks/router/redis_script_cost.py TREE RATE [SECONDS]
"""
import sys, subprocess, tempfile, json, collections
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.router.local_router import LocalRouter, project_env
import redis
import hashlib, importlib.util
def script_names(tree):
    names = {}
    for mod in ("lua", "lua_routers"):
        for base in (tree / "router/persistence" / f"{mod}.py", tree / "router" / f"{mod}.py"):
            if base.exists():
                sys.path.insert(0, str(tree))
                spec = importlib.util.spec_from_file_location("m_" + mod, base)
                try:
                    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
                except Exception as e:
                    print("cannot load", base, e); continue
                finally:
                    sys.path.pop(0)
                for k, v in vars(m).items():
                    if isinstance(v, str) and "redis.call" in v:
                        names[hashlib.sha1(v.encode()).hexdigest()[:8]] = k
    return names
tree = Path(sys.argv[1]).resolve(); rate = sys.argv[2]; dur = sys.argv[3] if len(sys.argv) > 3 else "4"
with LocalRouter(Path(tempfile.mkdtemp()), replicas=2, router_args=["--heartbeat-interval", "0.5"], router_tree=tree) as lr:
    r = redis.Redis.from_url(lr.redis_url)
    subprocess.run([sys.executable, "-m", "benchmarks.router.overhead", "--client", lr.grpc_address, "--rate", "50", "--duration", "1", "--vocab", str(lr.vocab), "--output-tokens", "1"], cwd=ROOT, capture_output=True, env=project_env())
    r.config_set("slowlog-log-slower-than", 0); r.config_set("slowlog-max-len", 200000); r.slowlog_reset()
    out = subprocess.run([sys.executable, "-m", "benchmarks.router.overhead", "--client", lr.grpc_address, "--rate", rate, "--duration", dur, "--vocab", str(lr.vocab), "--output-tokens", "1"], cwd=ROOT, capture_output=True, text=True, env=project_env())
    row = json.loads(out.stdout.strip().splitlines()[-1])
    n = row["completed"]
    log = r.slowlog_get(200000)
    agg = collections.defaultdict(list)
    for e in log:
        cmd = e["command"].split(b" ")
        key = cmd[0] if cmd[0].lower() != b"evalsha" else cmd[1][:8] + b" argc %d" % min(len(cmd), 99)
        agg[cmd[0] if cmd[0].lower() != b"evalsha" else cmd[1][:8]].append(e["duration"])
    print(tree.name, "rate", rate, "added p50 %.2f queue p50 %.2f" % (row["router_added_p50_ms"], row["router_queue_p50_ms"]))
    names = script_names(tree)
    tot = 0
    for k, v in sorted(agg.items(), key=lambda kv: -sum(kv[1]))[:6]:
        v = sorted(v); tot += sum(v)
        print("  ", names.get(k.decode(), k.decode()), "calls/req %.2f mean %.1f p50 %d us/req %.1f" % (len(v)/n, sum(v)/len(v), v[len(v)//2], sum(v)/n))
    print("   scripts us/req %.1f" % (sum(sum(v) for k, v in agg.items() if k.decode() in names or len(k) == 8 and k.islower())/n))
    text = Path(lr.log_path).read_text()
last = [l for l in text.splitlines() if "TRACE" in l]
if last:
    print(last[-1].split("TRACE ")[1].replace(" | ", "\n"))
