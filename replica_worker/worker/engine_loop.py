"""The engine's own thread: steps as soon as there is work, blocks when idle.

gRPC I/O and protobuf work stay on the asyncio side, so they overlap with
compute. Commands come in through a thread-safe inbox; each step's result
goes out through a callback that must be thread-safe (the worker hands it
to its event loop with call_soon_threadsafe).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from replica_worker.engine.errors import InvalidRequestError
from replica_worker.engine.kv_events import KVCacheEvents, PrefixCacheStats
from replica_worker.engine.outputs import EngineLoad, RequestDelta, StepResult
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.schedulers.base import AdmissionCapacity

if TYPE_CHECKING:  # the worker process imports this module without torch
    from replica_worker.engine.core import EngineCore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float | None = None
    resume_token_ids: tuple[int, ...] = ()
    resume_text_len: int | None = None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class ReportNow:
    """Asks for a report even when idle (a new router session needs the capacity)."""


@dataclass(frozen=True)
class EngineReport:
    """What the worker learns after each engine iteration."""

    result: StepResult
    capacity: AdmissionCapacity
    load: EngineLoad
    request_ids: tuple[str, ...]  # live requests after this step
    step_id: int = 0
    # Given up after a recoverable engine error: the router resumes them elsewhere.
    handed_back: tuple[str, ...] = ()
    # The prefix cache's changes since the previous report, and its counters
    # (None: the engine keeps no prefix cache).
    kv_events: KVCacheEvents | None = None
    prefix_stats: PrefixCacheStats | None = None


# Exit status of a replica whose accelerator failed (sysexits' EX_SOFTWARE).
DEVICE_FAILED_EXIT = 70


def is_fatal_device_error(exc: BaseException) -> bool:
    """A CUDA error other than out-of-memory leaves the context unusable: every later
    kernel fails too, so the process cannot serve again (an OOM can be recovered)."""
    if "out of memory" in str(exc).lower():
        return False
    # torch is only imported where an engine runs: without it, no error is torch's.
    torch = sys.modules.get("torch")
    return isinstance(exc, getattr(torch, "AcceleratorError", ())) or "CUDA error" in str(exc)


def exit_now(status: int) -> None:
    """Ends the process at once, its log flushed; a supervisor (Kubernetes, compose)
    restarts it."""
    logging.shutdown()
    os._exit(status)


def exit_process(exc: BaseException) -> None:
    """Ends the replica at once, as a crash would: its stream drops, and the router
    requeues its requests (with the tokens they already have) onto other replicas
    instead of failing them here."""
    log.critical("engine cannot go on (%s); exiting with status %d so the router moves this "
                 "replica's requests elsewhere", exc, DEVICE_FAILED_EXIT)
    exit_now(DEVICE_FAILED_EXIT)


class EngineLoop:
    def __init__(self, engine: EngineCore, on_report: Callable[[EngineReport], None],
                 on_device_failure: Callable[[BaseException], None] = exit_process):
        self._engine = engine
        self._on_report = on_report
        self._on_device_failure = on_device_failure
        self._inbox: deque = deque()
        self._rejected: list[RequestDelta] = []   # this iteration's refused adds, until reported
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def request_report(self) -> None:
        self.submit(ReportNow())

    def submit(self, command: AddRequest | AbortRequest | ReportNow) -> None:
        with self._wake:
            self._inbox.append(command)
            self._wake.notify()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stops stepping, then shuts the engine down (its other tensor-parallel
        ranks): whoever stops the loop is done with the engine, and a process may
        end without its interpreter's exit handlers (replica_worker/__main__.py)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._engine.shutdown()

    def _run(self) -> None:
        while True:
            with self._wake:
                # Block while idle: no timer puts a floor under token gaps.
                while not self._stopped and not self._inbox and not self._engine.has_unfinished():
                    self._wake.wait()
                if self._stopped:
                    return
                commands = list(self._inbox)
                self._inbox.clear()
            try:
                self._iterate(commands)
            except Exception as exc:  # a broken step must not kill the thread silently
                on_device = is_fatal_device_error(exc)
                if on_device or not getattr(self._engine, "step_errors_recoverable", True):
                    # With tensor-parallel ranks a failed step may have left them inside a
                    # collective: no later step could be trusted either.
                    log.exception("engine step failed %s", "on the accelerator" if on_device
                                  else "with tensor-parallel ranks, which cannot resume mid-step")
                    self._on_device_failure(exc)
                    return
                # Recoverable (an out-of-memory step, say): the engine frees
                # everything and the router resumes the work from what it has.
                log.exception("engine step failed; handing its requests back")
                try:
                    self._hand_back_all()
                except Exception as again:
                    # The engine cannot even give its work back: no later step can
                    # be trusted, and a thread that died here would leave the worker
                    # renewing leases of work that never moves.
                    log.exception("handing requests back after a failed step failed too")
                    self._on_device_failure(again)
                    return

    def _iterate(self, commands: list) -> None:
        # Kept until reported: a step that fails after them hands them back with the rest.
        self._rejected = [d for d in (self._apply(c) for c in commands) if d is not None]
        result = self._engine.step() if self._engine.has_unfinished() else StepResult(deltas=[])
        result.deltas[:0] = self._rejected
        self._rejected = []
        self._report(result)

    def _apply(self, command) -> RequestDelta | None:
        if isinstance(command, ReportNow):
            return None
        if isinstance(command, AbortRequest):
            self._engine.abort_request(command.request_id)
            return None
        try:
            self._engine.add_request(
                command.request_id,
                command.prompt_token_ids,
                command.params,
                arrival_time=command.arrival_time,
                resume_token_ids=list(command.resume_token_ids),
                resume_text_len=command.resume_text_len,
            )
        except InvalidRequestError as exc:
            error = str(exc)
        except Exception as exc:
            # Fail this request only: the rest of the batch (other adds, aborts)
            # must still be applied, or its requests would hang unseen.
            log.exception("adding request %s failed", command.request_id)
            error = f"replica failed to add the request: {exc}"
            try:
                self._engine.abort_request(command.request_id)  # in case it got half in
            except Exception:
                log.exception("cleaning up request %s failed", command.request_id)
        else:
            return None
        return RequestDelta(
            command.request_id, [], "", len(command.resume_token_ids),
            finish_reason="error", error=error,
        )

    def _report(self, result: StepResult, handed_back: tuple[str, ...] = ()) -> None:
        # Read here, on the engine's own thread: the engine is not thread-safe.
        engine = self._engine
        caching = engine.prefix_caching_enabled
        self._on_report(EngineReport(
            result=result,
            capacity=engine.admission_capacity(),
            load=engine.load(),
            request_ids=tuple(engine.request_ids()),
            step_id=engine.step_id,
            handed_back=handed_back,
            kv_events=engine.take_kv_events() if caching else None,
            prefix_stats=engine.prefix_cache_stats() if caching else None,
        ))

    def _hand_back_all(self) -> None:
        """After a recoverable failed step: every request still inside the engine
        goes back, and what ended before the failure is reported with them (adds
        refused in that iteration, deltas the step had resolved before its launch
        failed), so no request is left neither finished nor handed back."""
        ids = tuple(self._engine.request_ids())
        for rid in ids:
            self._engine.abort_request(rid)
        take = getattr(self._engine, "take_undelivered", None)
        deltas = self._rejected + (take() if take is not None else [])
        self._rejected = []
        self._report(StepResult(deltas=deltas), handed_back=ids)
