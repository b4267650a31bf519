"""gRPC load generator: sends each request at its arrival time over a few shared
channels (many concurrent server streams each) and times every delta on arrival.
A conversation (multi-turn) sends its turns one after another, each turn's
prompt built from the previous prompt, the answer received and a new message."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import grpc

from client.api import FINISH_NAMES, aio_channel, make_request, metadata
from common.pb.quadriga.v1 import generation_pb2_grpc

from benchmarks.harness.prefix_workloads import conversations
from benchmarks.harness.workload import Request

# A router that requires client API keys gets the one in QUADRIGA_API_KEY (environment only).
_API_KEY_METADATA = metadata(os.environ.get("QUADRIGA_API_KEY", "")) or None


@dataclass
class Result:
    index: int
    prompt_len: int
    output_len: int                      # wanted
    scheduled_s: float                   # planned arrival offset
    sent_s: float = 0.0                  # actual send offset from the run start
    first_token_s: float | None = None   # offsets from the run start
    finished_s: float | None = None
    token_times: list[float] = field(default_factory=list, repr=False)  # one per token
    output_tokens: int = 0               # tokens received
    finish_reason: str = ""
    error: str = ""
    # From the server's last message.
    server_queue_s: float | None = None
    server_sched_delay_s: float | None = None
    server_ttft_s: float | None = None
    server_e2e_s: float | None = None
    replica: str = ""
    preemptions: int = 0
    requeues: int = 0
    server_prompt_tokens: int = 0
    server_output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return not self.error and self.finish_reason in ("length", "stop")

    # From the planned arrival, not the send: a load generator whose loop stalls
    # sends late, and timing from the late send would leave the stall out of the
    # latency a client arriving on time sees (coordinated omission).
    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.scheduled_s

    @property
    def e2e(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.scheduled_s

    @property
    def send_lag(self) -> float:
        """How late the load generator sent it."""
        return self.sent_s - self.scheduled_s

    @property
    def tbts(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


class Progress:
    """One status line on stderr: \\r-rewritten on a terminal, a line every 10 s otherwise."""

    def __init__(self, total: int, label: str = "", enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled
        self.sent = self.done = self.errors = 0
        self.max_loop_lag_s = 0.0
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def show(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < (0.5 if self.tty else 10.0):
            return
        self._last = now
        el = now - self.t0
        line = (f"{self.label} {self.done}/{self.total} done, {self.sent - self.done} in flight, "
                f"{self.errors} errors, {el:.0f} s, {self.done / el if el else 0:.2f} req/s")
        sys.stderr.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        if force and self.tty:
            sys.stderr.write("\n")
        sys.stderr.flush()


_INFLIGHT = re.compile(r'^quadriga_inflight_requests\{[^}]*replica="([^"]*)"[^}]*\}\s+([0-9.eE+-]+)', re.M)


def scrape_inflight(url: str, timeout: float = 1.0) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    return {m.group(1): float(m.group(2)) for m in _INFLIGHT.finditer(text)}


async def _scraper(url: str, t0: float, period: float, out: list, stop: asyncio.Event):
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        try:
            values = await loop.run_in_executor(None, scrape_inflight, url)
            out.append((time.monotonic() - t0, values))
        except Exception:  # noqa: BLE001 - a missed scrape is a gap in a plot, not a failure
            pass
        try:
            await asyncio.wait_for(stop.wait(), period)
        except asyncio.TimeoutError:
            pass


async def _sleep_until(t0: float, offset: float) -> None:
    delay = t0 + offset - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def _one(stub, req: Request, res: Result, t0: float, *args):
    await _sleep_until(t0, req.arrival_s)
    await _send(stub, req, res, t0, *args)


async def _conversation(stub, turns: list[Request], results: list[Result], t0: float, *args):
    """Turn by turn: each prompt is the previous prompt, its answer and a new message."""
    await _sleep_until(t0, turns[0].arrival_s)
    context: list[int] = []
    for k, (req, res) in enumerate(zip(turns, results)):
        if k:   # planned: the previous answer, then the user's think time
            res.scheduled_s = results[k - 1].finished_s + req.think_s
            await _sleep_until(t0, res.scheduled_s)
        answer: list[int] = []
        await _send(stub, req, res, t0, *args, prompt=context + req.prompt_token_ids, answer=answer)
        if not res.ok or res.output_tokens != req.output_len:
            for later in results[k + 1:]:
                later.error = f"turn {k + 1} of its conversation failed"
            return
        context = context + req.prompt_token_ids + answer


async def _send(stub, req: Request, res: Result, t0: float, stream_interval: int, timeout: float,
                progress: Progress, temperature: float, prompt: list[int] | None = None,
                answer: list[int] | None = None):
    """Sends one request and streams its answer (its token ids into `answer` if given)."""
    msg = make_request(req.prompt_token_ids if prompt is None else prompt, max_tokens=req.output_len,
                       temperature=temperature, ignore_eos=True, stream_interval=stream_interval)
    res.sent_s = time.monotonic() - t0
    progress.sent += 1
    try:
        call = stub.Generate(msg, timeout=timeout, metadata=_API_KEY_METADATA)
        async for m in call:
            now = time.monotonic() - t0
            k = len(m.token_ids)
            if k:
                if res.first_token_s is None:
                    res.first_token_s = now
                # A coalesced message delivers k tokens at once: the gaps inside it are 0.
                res.token_times.extend([now] * k)
                res.output_tokens += k
                if answer is not None:
                    answer.extend(m.token_ids)
            if m.HasField("finish_reason"):
                res.finished_s = now
                res.finish_reason = FINISH_NAMES.get(m.finish_reason, str(m.finish_reason))
                res.error = m.error
                t = m.timings
                res.server_queue_s = t.queue_time_s
                res.server_sched_delay_s = t.scheduling_delay_s
                res.server_ttft_s = t.time_to_first_token_s
                res.server_e2e_s = t.end_to_end_s
                res.replica = t.replica_id
                res.preemptions = t.preemptions
                res.requeues = t.requeues
                res.server_prompt_tokens = t.prompt_tokens
                res.server_output_tokens = t.output_tokens
        if res.finished_s is None:
            res.error = res.error or "stream ended without finish_reason"
    except grpc.aio.AioRpcError as exc:
        res.error = f"{exc.code().name}: {exc.details()}"
    except Exception as exc:  # noqa: BLE001
        res.error = f"{type(exc).__name__}: {exc}"
    if res.finished_s is None:
        res.finished_s = time.monotonic() - t0
    if res.error or res.output_tokens != req.output_len:
        progress.errors += 1
    progress.done += 1
    progress.show()


async def _loop_lag(stop: asyncio.Event, prog: "Progress", period: float = 0.02) -> None:
    """The longest the client's event loop was late to wake: a stall of the load
    generator itself, which every request in flight counts as latency."""
    while not stop.is_set():
        due = time.monotonic() + period
        await asyncio.sleep(period)
        prog.max_loop_lag_s = max(prog.max_loop_lag_s, time.monotonic() - due)


async def run_requests(address: str, requests: list[Request], *, channels: int = 2,
                       stream_interval: int = 1, timeout: float = 600.0, metrics_url: str | None = None,
                       scrape_period: float = 0.5, label: str = "", progress: bool = True,
                       temperature: float = 0.0) -> tuple[list[Result], list, float, float]:
    """Returns per-request results, (t, {replica: inflight}) scrapes, the run's wall time,
    and the longest stall of the client's own event loop (seconds).
    """
    chans = [aio_channel(address) for _ in range(max(1, channels))]
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in chans]
    for c in chans:
        await asyncio.wait_for(c.channel_ready(), 30)
    results = [Result(r.index, r.prompt_len, r.output_len, r.arrival_s) for r in requests]
    prog = Progress(len(requests), label, progress)
    scrapes: list = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    scraper = asyncio.create_task(_scraper(metrics_url, t0, scrape_period, scrapes, stop)) if metrics_url else None
    args = (t0, stream_interval, timeout, prog, temperature)
    by_index = {r.index: res for r, res in zip(requests, results)}
    singles, chains = conversations(requests)
    tasks = [asyncio.create_task(_one(stubs[i % len(stubs)], r, by_index[r.index], *args))
             for i, r in enumerate(singles)]
    tasks += [asyncio.create_task(_conversation(stubs[i % len(stubs)], turns,
                                                [by_index[r.index] for r in turns], *args))
              for i, turns in enumerate(chains)]
    ticker_stop = asyncio.Event()

    async def ticker():
        while not ticker_stop.is_set():
            prog.show()
            try:
                await asyncio.wait_for(ticker_stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    tick = asyncio.create_task(ticker())
    lag = asyncio.create_task(_loop_lag(ticker_stop, prog))
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    ticker_stop.set()
    stop.set()
    await tick
    await lag
    if scraper:
        await scraper
    prog.show(force=True)
    for c in chans:
        await c.close()
    return results, scrapes, wall, prog.max_loop_lag_s
