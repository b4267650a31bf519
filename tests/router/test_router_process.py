"""What `python -m router` does for the process it owns, which a router built
inside a test process does not: it freezes its heap once started
(router/server.py freeze_heap), and exports the process's own series beside
the router's."""

import re
import urllib.request

from common.redis_server import free_port
from stack.processes import Child, wait_for_health


def _value(text: str, series: str) -> float:
    found = re.search(rf"^{re.escape(series)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert found, f"{series} not exported:\n{text[:2000]}"
    return float(found.group(1))


def test_a_router_process_freezes_its_heap_and_exports_the_process_series(tmp_path, redis_url,
                                                                           tiny_model):
    port, metrics_port = free_port(), free_port()
    router = Child("router", ["-m", "router", "--port", str(port), "--host", "127.0.0.1",
                              "--redis-url", redis_url, "--model", str(tiny_model),
                              "--metrics-port", str(metrics_port)], tmp_path)
    try:
        wait_for_health(f"127.0.0.1:{port}", router, timeout=60)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                      timeout=10).read().decode()
    finally:
        router.stop(timeout=10)
    # A started router holds hundreds of thousands of objects (its modules,
    # grpc, FastAPI); unfrozen, the gauge reads 0.
    assert _value(text, "quadriga_router_heap_frozen_objects") > 50_000
    assert _value(text, "process_resident_memory_bytes") > 0
    assert _value(text, 'python_gc_collections_total{generation="2"}') >= 0
