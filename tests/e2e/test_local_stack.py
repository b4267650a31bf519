"""The README's main job: `python -m stack` answers real requests and stops cleanly on
Ctrl-C, and on a SIGTERM to its whole process group (what `timeout` sends: every child
gets it at once, and the stack still stops them all and exits 0)."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

from common.redis_server import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def _running_stack(tmp_path, tiny_model, port: int, *extra: str, http_port: int | None = None):
    """The stack in a session of its own, read up to its "ready:" line; yields it and
    the lines read, and kills its whole group on the way out if it still runs."""
    stack = subprocess.Popen(
        [sys.executable, "-m", "stack", "--replicas", "2", "--port", str(port),
         "--metrics-port", str(free_port()), "--http-port", str(http_port or free_port()),
         "--model", str(tiny_model),
         "--log-dir", str(tmp_path), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    lines = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = stack.stdout.readline()
            assert line, "stack exited early:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("ready:"):
                break
        yield stack, lines
    finally:
        if stack.poll() is None:
            os.killpg(stack.pid, signal.SIGKILL)


def _assert_stops_cleanly(stack) -> None:
    rest, _ = stack.communicate(timeout=60)
    assert stack.returncode == 0, rest
    assert "stopping" in rest


def _assert_nothing_left(port: int, lines: list[str]) -> None:
    """Every child is gone with the stack: the router (--port P), the replicas
    (--router 127.0.0.1:P) and Redis (its process title names 127.0.0.1:port).
    pgrep exits 1 when nothing matches."""
    redis_port = re.search(r"redis://127\.0\.0\.1:(\d+)", "".join(lines)).group(1)
    for pattern in (f"--port {port}", f"127.0.0.1:{port}", f"127.0.0.1:{redis_port}"):
        leftovers = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True)
        assert leftovers.returncode == 1, f"still running: {leftovers.stdout}"


def _client(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "client", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_stack_serves_the_client_cli_and_stops_on_ctrl_c(tmp_path, tiny_model):
    port, http_port = free_port(), free_port()
    with _running_stack(tmp_path, tiny_model, port, http_port=http_port) as (stack, lines):
        assert any("embedded" in x for x in lines), "no --redis-url: an embedded Redis is started"
        client = subprocess.run(
            [sys.executable, "-m", "client", "--router", f"127.0.0.1:{port}", "café 東京",
             "--max-tokens", "12", "--temperature", "0", "--ignore-eos", "--timings"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert client.returncode == 0, client.stderr
        assert "[length]" in client.stderr
        assert "output_tokens: 12" in client.stderr
        # --chat goes through the OpenAI API and carries every flag it can: the
        # request id makes a second call replay the first's answer.
        chat = ["--chat", "hello", "--http", f"http://127.0.0.1:{http_port}/v1", "--max-tokens", "6",
                "--temperature", "1", "--top-k", "3", "--ignore-eos", "--request-id", "chat-1"]
        first, again = _client(*chat), _client(*chat)
        assert first.returncode == 0 and "[length]" in first.stderr, first.stderr
        assert first.stdout and again.stdout == first.stdout
        refused = _client("--chat", "hello", "--timings")
        assert refused.returncode == 2 and "--timings" in refused.stderr
        # A request that ends in an error exits 1.
        failed = _client("--router", f"127.0.0.1:{port}", "hello", "--max-tokens", "100000")
        assert failed.returncode == 1 and "INVALID_ARGUMENT" in failed.stderr, failed.stderr
        stack.send_signal(signal.SIGINT)
        _assert_stops_cleanly(stack)
    _assert_nothing_left(port, lines)


def test_a_sigterm_to_the_whole_group_stops_every_process(tmp_path, tiny_model):
    port = free_port()
    with _running_stack(tmp_path, tiny_model, port) as (stack, lines):
        os.killpg(stack.pid, signal.SIGTERM)
        _assert_stops_cleanly(stack)
    _assert_nothing_left(port, lines)


def test_the_stack_runs_simulated_replicas_on_request(tmp_path, tiny_model):
    """--simulate PROFILE: the replicas are python -m replica_worker.sim, whose tokens
    follow the simulator's rule (consecutive ids, replica_worker/sim/runner.py), not
    the model's."""
    port = free_port()
    with _running_stack(tmp_path, tiny_model, port, "--simulate", "h200-8b") as (stack, lines):
        assert sum("registered (simulated, profile h200-8b" in x for x in lines) == 2, "".join(lines)
        client = subprocess.run(
            [sys.executable, "-m", "client", "--router", f"127.0.0.1:{port}", "hello",
             "--max-tokens", "5", "--ignore-eos", "--timings"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert client.returncode == 0, client.stderr
        ids = [int(t) for t in re.findall(r"<(\d+)>", client.stdout)]
        assert len(ids) == 5 and all(b == a + 1 for a, b in zip(ids, ids[1:])), client.stdout
        stack.send_signal(signal.SIGINT)
        _assert_stops_cleanly(stack)
    _assert_nothing_left(port, lines)
