"""The engine core in a process of its own, as vLLM's EngineCoreProc runs it.

The worker's process keeps the gRPC stream, protobuf, the replay history and
detokenization; the engine process only schedules, runs the model and
samples, so no Python work of the worker's ever holds the GIL while the GPU
waits for its next step. The two talk over a pipe: commands down, one report
per engine iteration up, each one msgpack message (engine_wire.py).

Lifetimes are tied both ways:
- the engine process ignores SIGINT and SIGTERM (a drain is the worker's
  to run) and ends when the worker says Stop or its pipe closes, which is
  how it notices a worker that was killed; while it builds its engine (tens
  of seconds on a GPU) it reads no pipe, so a watchdog ends it once its
  worker is gone (it is re-parented): a worker killed during its start must
  not leave an orphan holding the accelerator's memory that its restarted
  self needs;
- a worker whose engine process died (an accelerator error ends it with
  DEVICE_FAILED_EXIT) exits with the same status, so the router requeues
  the replica's work elsewhere, as it does for any replica that dies.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from typing import Callable

from replica_worker.engine.config import EngineConfig
from replica_worker.engine.output_text import OutputTexts
from replica_worker.worker import engine_wire
from replica_worker.worker.engine_loop import DEVICE_FAILED_EXIT, EngineLoop, EngineReport, exit_now, exit_process

log = logging.getLogger(__name__)

_START_POLL_S = 0.5
_STOP_TIMEOUT_S = 10.0
_ORPHAN_POLL_S = 0.5


class EngineProcess:
    """Starts the engine process and waits until its engine is built. What the
    worker would read of an EngineCore (its prefix cache, its capacity) is in
    `info`; `output_texts` detokenizes for it here (None without a tokenizer)."""

    def __init__(self, config: EngineConfig, tokenizer=None, threads: int = 0,
                 on_exit: Callable[[int], None] | None = None) -> None:
        eos = getattr(tokenizer, "eos_token_id", None)
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=_engine_main, name="engine-core",
                                    args=(config, child_conn, threads, eos), daemon=False)
        self._process.start()
        child_conn.close()
        self.info = self._wait_for_info()
        self.output_texts = OutputTexts(tokenizer) if tokenizer is not None else None
        self._on_exit = on_exit or exit_now   # the replica ends as its engine did
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader: threading.Thread | None = None

    def _wait_for_info(self) -> engine_wire.EngineInfo:
        while not self._conn.poll(_START_POLL_S):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine process exited while starting "
                                   f"(status {self._process.exitcode}); its log says why")
        try:
            return engine_wire.decode_info(self._conn.recv_bytes())
        except EOFError:
            self._process.join(_STOP_TIMEOUT_S)
            raise RuntimeError(f"the engine process exited while starting (status {self._process.exitcode})") \
                from None

    # ---- the EngineLoop interface the worker drives ----
    def attach(self, on_report: Callable[[EngineReport], None],
               on_exit: Callable[[int], None] | None = None) -> "EngineProcess":
        """Reports go to on_report, from a thread of this process's own (as
        EngineLoop's do from the engine thread); on_exit, if given, replaces
        what runs when the engine process ends while still needed."""
        if on_exit is not None:
            self._on_exit = on_exit
        self._reader = threading.Thread(target=self._read_reports, args=(on_report,),
                                        name="engine-reports", daemon=True)
        return self

    def start(self) -> None:
        self._reader.start()

    def submit(self, command) -> None:
        self._send(engine_wire.encode_command(command))

    def request_report(self) -> None:
        self.submit(engine_wire.ReportNow())

    def stop(self, timeout: float | None = _STOP_TIMEOUT_S) -> None:
        self._stopping = True
        try:
            self._send(engine_wire.encode_command(engine_wire.Stop()))
        except OSError:
            pass  # already gone
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout or 0)
            self._process.kill()
            self._process.join(timeout)
        self._conn.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # ---- what the worker reads of an engine, as of EngineCore ----
    @property
    def prefix_caching_enabled(self) -> bool:
        return self.info.hasher is not None

    @property
    def block_hasher(self):
        return self.info.hasher

    def cached_block_hashes(self) -> list[int]:
        """At start-up: the worker reads it once, before the reports begin."""
        return list(self.info.cached_block_hashes)

    # ---- inside ----
    def _send(self, data: bytes) -> None:
        with self._send_lock:
            self._conn.send_bytes(data)

    def _read_reports(self, on_report: Callable[[EngineReport], None]) -> None:
        while True:
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):
                break
            on_report(engine_wire.decode_report(data))
        if self._stopping:
            return
        self._process.join(_STOP_TIMEOUT_S)
        status = self._process.exitcode
        log.critical("the engine process ended (status %s) while the worker still needed it", status)
        # A signal's death (a negative status) or none known reads as a failed device.
        self._on_exit(status if status and status > 0 else DEVICE_FAILED_EXIT)




def _engine_main(config: EngineConfig, conn, threads: int, tokenizer_eos) -> None:
    """The engine process: builds the engine, reports its info, then applies
    commands from the pipe while its EngineLoop steps and sends reports back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    threading.Thread(target=_end_when_orphaned, args=(os.getppid(),), name="orphan-watch",
                     daemon=True).start()
    if threads:
        import torch

        torch.set_num_threads(threads)
    from replica_worker.engine.core import EngineCore

    engine = EngineCore(config)
    if tokenizer_eos is not None:  # the tokenizer's EOS ends requests too, as in-process
        engine.eos_token_ids = engine.eos_token_ids | set(
            tokenizer_eos if isinstance(tokenizer_eos, list) else [tokenizer_eos])
    try:
        conn.send_bytes(engine_wire.encode_info(engine_wire.EngineInfo.of(engine)))
    except OSError:
        log.warning("the worker went away while the engine was being built; the engine process ends")
        engine.shutdown()
        return
    send_lock = threading.Lock()

    def send_report(report: EngineReport) -> None:
        data = engine_wire.encode_report(report)
        with send_lock:
            try:
                conn.send_bytes(data)
            except OSError:
                pass  # the worker is gone; the command reader ends the process

    loop = EngineLoop(engine, send_report, on_device_failure=exit_process)
    loop.start()
    try:
        while True:
            try:
                command = engine_wire.decode_command(conn.recv_bytes())
            except (EOFError, OSError):
                log.warning("the worker's pipe closed; the engine process ends")
                break
            if isinstance(command, engine_wire.Stop):
                break
            loop.submit(command)
    finally:
        loop.stop()   # shuts the engine down too


def _end_when_orphaned(worker_pid: int) -> None:
    """Ends this process once its worker has died (it is then re-parented,
    so its parent is no longer the worker). Polls: a pipe would tell only
    while it is being read, and during the build nothing reads it."""
    while os.getppid() == worker_pid:
        time.sleep(_ORPHAN_POLL_S)
    log.warning("the worker (process %d) is gone; the engine process ends", worker_pid)
    logging.shutdown()
    os._exit(0)
