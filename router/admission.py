"""The one request path both front ends share: validate, tokenize, place and
admit a plain RequestSpec, or find the request it re-attaches to; cancel.

A request is accepted once its submit is durable in Redis. Until then the
client waits, at most `submit_timeout`; past it the client is told
UNAVAILABLE and the request is withdrawn (table.withdraw), so a retry with
the same request_id either re-attaches or starts afresh, never meets a ghost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.tokenizer import encode_prompt, has_chat_template, load_encoder, load_tokenizer
from router.persistence.store import record_from_flat
from router.persistence.writer import PermanentWriteError
from router.requests.record import state_from_record
from router.requests.request import RequestState
from router.requests.spec import RequestSpec
from router.scheduling.policies import Arrival
from router.validation import (ModelLimits, RouterError, check_request, effective_max_tokens,
                               invalid, unavailable)

log = logging.getLogger(__name__)


class Admission:
    def __init__(self, config, limits: ModelLimits, table, scheduler, registry, writer, store,
                 metrics):
        self.config = config
        self.limits = limits
        self.table = table
        self.scheduler = scheduler
        self.registry = registry
        self.writer = writer
        self.store = store
        self.metrics = metrics
        self.stopping = False
        self.waiting_for_replica = 0
        # Replicas connected to the other live routers (set by the router's wiring).
        self.replicas_elsewhere = lambda: 0
        # Called on the loop once a tokenizer has loaded (the router freezes its heap then).
        self.on_loaded = lambda: None
        self.executor = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        self._tokenizer: asyncio.Future | None = None   # transformers', loaded when first needed
        self._encoder: asyncio.Future | None = None

    def start(self) -> None:
        """Starts loading the prompt encoder without waiting for it. The fast
        tokenizer alone loads in milliseconds; transformers (chat templates,
        logprobs' token strings, a folder the fast path cannot read) takes
        seconds, and its import holds the GIL in stretches that pause the loop,
        just when a restarted router must take replicas and re-attaches. It is
        loaded now when prompts need it, at start when chat will (prepare_chat),
        else on first use."""
        loop = asyncio.get_running_loop()
        self._encoder = loop.run_in_executor(self.executor, load_encoder, self.config.model)
        self._encoder.add_done_callback(self._encoder_loaded)

    def _encoder_loaded(self, future: asyncio.Future) -> None:
        if future.cancelled():
            return   # stopping
        self.on_loaded()
        if future.exception() is not None:
            log.warning("the fast tokenizer of %s did not load (%s); prompts are encoded "
                        "with transformers' tokenizer", self.config.model, future.exception())
        if future.exception() is not None or future.result() is None:
            self._load_tokenizer()   # prompts need transformers' tokenizer (or its error)

    def _load_tokenizer(self) -> asyncio.Future:
        if self._tokenizer is None:
            loop = asyncio.get_running_loop()
            self._tokenizer = loop.run_in_executor(self.executor, load_tokenizer, self.config.model)
            self._tokenizer.add_done_callback(self._tokenizer_loaded)
        return self._tokenizer

    def _tokenizer_loaded(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:   # the exception is retrieved
            self.on_loaded()

    def prepare_chat(self) -> None:
        """With the OpenAI door open and a chat template in the folder, starts loading
        transformers' tokenizer now, in the background: every chat request needs it
        (the template), and loaded on first use it made the first chat call wait the
        seconds the load takes. The loop keeps running meanwhile; the load's import
        only pauses it now and then, briefly."""
        if has_chat_template(self.config.model):
            self._load_tokenizer()

    @property
    def tokenizer_requested(self) -> bool:
        """Whether transformers' tokenizer was needed (and so is loading or loaded)."""
        return self._tokenizer is not None

    async def tokenizer(self):
        """transformers' tokenizer of the model (loaded on first use)."""
        return await asyncio.shield(self._load_tokenizer())

    async def _prompt_encoder(self):
        try:
            encoder = await asyncio.shield(self._encoder)
        except Exception:   # an unreadable tokenizer.json (logged): transformers' answers
            encoder = None
        return encoder if encoder is not None else await self.tokenizer()

    def stop(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ---- open ----
    async def open(self, spec: RequestSpec, made_id: str | None = None) -> RequestState:
        """Validates and accepts a request, or finds the one it re-attaches to.
        made_id: the id to give a request without a client's id (a front door that
        names its calls itself); it must be unique, as a fresh random id is."""
        check_request(spec, self.limits)
        if not spec.stream_interval:
            # Stored and sent to the replica as resolved here, so the replica
            # coalesces as this router's subscribers would.
            spec = dataclasses.replace(spec, stream_interval=self.config.stream_interval)
        digest = spec.digest()
        if spec.request_id:
            found = self._in_memory(spec.request_id, digest)
            if found is not None:
                return found
        self._check_room()
        ids = list(spec.prompt_token_ids) if spec.prompt_token_ids else await self._tokenize(spec.prompt)
        max_tokens = effective_max_tokens(spec, len(ids), self.limits)
        await self._wait_for_replica()
        # Random, so unguessable: anyone holding an id may re-attach and read the output.
        rid = spec.request_id or made_id or os.urandom(16).hex()
        found = self._in_memory(rid, digest)  # the same id may have arrived meanwhile
        if found is not None:
            return found
        queue = self.scheduler.arrival_queue(ids, max_tokens)
        # Only an id the router made may start before Redis holds it (table.admit);
        # a client's, taken at arrival, is held until its submit is stored.
        held = bool(spec.request_id)
        taker = self.scheduler.take_at_arrival(Arrival(ids, max_tokens), queue, held)
        if taker is not None:
            req, stored = self.table.admit(spec, ids, max_tokens, queue, rid, digest,
                                           tell_others=False, replica=taker.id)
            if held:
                self.scheduler.hold_at_arrival(taker, req)
            else:
                self.scheduler.assigned_at_arrival(taker, req, queue)
        else:
            held = False
            req, stored = self.table.admit(spec, ids, max_tokens, queue, rid, digest,
                                           tell_others=not self.scheduler.takes_arrival(queue))
        try:
            # The writer fails the reply's future past submit_timeout, and a
            # client gone cancels it; either way the writer still stores the
            # submit, and withdraw removes it once it has landed.
            created, value, state = await stored
        except TimeoutError:
            self._withdraw(req)
            raise unavailable(f"Redis did not store the request within {self.config.submit_timeout:g} s; "
                              "retry (with the same request_id to be safe)", "store") from None
        except PermanentWriteError as exc:   # this router was fenced, or Redis refused the script
            self._withdraw(req)
            raise unavailable(f"the router could not store the request ({exc}); retry, on another "
                              "router if there is one", "store") from None
        except BaseException:
            self._withdraw(req)
            raise
        if not int(created):
            self.scheduler.release_held(rid)
            self.table.forget_unstored(req)
            return await self._from_store(rid, digest, value.decode())
        self.table.confirm(req)
        if held:
            self.scheduler.send_held(req, queue)
        return req

    def _withdraw(self, req: RequestState) -> None:
        # Still on its replica, a held request's Cancel is not sent and its seat
        # comes back (server._cancel_on_replica); requeued meanwhile (its replica
        # left), it is released here.
        self.table.withdraw(req)
        self.scheduler.release_held(req.id)

    def _in_memory(self, rid: str, digest: str) -> RequestState | None:
        if self.table.withdrawing(rid):
            raise unavailable(f"request {rid!r} is being withdrawn after a Redis timeout; retry",
                              "withdrawing")
        req = self.table.get(rid)
        if req is None:
            return None
        self._same_body(req.digest, digest, rid)
        return req

    @staticmethod
    def _same_body(stored: str, digest: str, rid: str) -> None:
        if stored != digest:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request_id {rid!r} is in use by a different request (prompt, "
                              "sampling or priority differ); re-attaching needs the identical "
                              "request, otherwise choose a new request_id", "duplicate_id")

    def _check_room(self) -> None:
        if self.stopping:
            raise unavailable("the router is shutting down; retry on its successor", "stopping")
        waiting = self.table.queued_total + self.waiting_for_replica
        if waiting >= self.config.queue_limit:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"queue is full ({self.config.queue_limit} requests waiting); "
                              "retry later", "queue_full")
        why = self.writer.accepting()
        if why is not None:
            raise unavailable(f"the router takes no new requests now: {why}; retry", "store")

    async def _tokenize(self, prompt: str) -> list[int]:
        loop = asyncio.get_running_loop()
        try:
            encoder = await self._prompt_encoder()
            if len(prompt) <= self.config.inline_tokenize_chars:
                # A short prompt encodes in tens of microseconds, less than
                # the hand-off to a tokenizer thread and back costs.
                return encode_prompt(encoder, prompt)
            return await loop.run_in_executor(self.executor, encode_prompt, encoder, prompt)
        except Exception as exc:  # a tokenizer failure is answered, never swallowed
            raise RouterError(grpc.StatusCode.INTERNAL, f"tokenizing the prompt failed: {exc}",
                              "tokenizer") from exc

    async def render_chat(self, messages: list[dict]) -> tuple[int, ...]:
        """The model's own chat template with the generation prompt, as token ids.
        The template writes any special tokens itself, so none are added."""
        tokenizer = await self.tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise invalid(f"model {self.config.served_model_name} has no chat template; "
                          "send a prompt to /v1/completions instead")

        def render() -> tuple[int, ...]:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, render)
        except Exception as exc:  # a template that refuses these messages
            raise invalid(f"the chat template refused the messages: {exc}") from exc

    def _replica_anywhere(self) -> bool:
        return bool(len(self.registry) or self.replicas_elsewhere())

    async def _wait_for_replica(self) -> None:
        """Until a replica is connected here or to another router: any of them
        may pull the request from the shared queue."""
        if self._replica_anywhere():
            return
        self.waiting_for_replica += 1
        try:
            async with asyncio.timeout(self.config.no_replica_timeout):
                while not self._replica_anywhere():
                    try:
                        await asyncio.wait_for(self.registry.any_replica.wait(), 0.25)
                    except asyncio.TimeoutError:
                        pass
        except TimeoutError:
            raise unavailable(f"no replica serving {self.config.served_model_name} connected within "
                              f"{self.config.no_replica_timeout:g} s", "no_replica") from None
        finally:
            self.waiting_for_replica -= 1

    async def _from_store(self, rid: str, digest: str, stored_digest: str) -> RequestState:
        """The id exists in Redis but not in memory: a finished request kept for
        result_ttl, or a live one this router does not hold (another router
        accepted it, or this router's earlier life). ATTACH makes this router
        one of its fronts and reads its output in the same step, so the output
        replayed and what follows through events (events.py) meet exactly."""
        self._same_body(stored_digest, digest, rid)
        self.table.begin_attach(rid)
        reply = self.writer.call(self.store.attach(rid, digest))
        try:
            # Shielded: a client that leaves meanwhile does not stop the ATTACH,
            # which names this router a front in Redis whatever the client does.
            # Bounded as a submit is: past submit_timeout the client is told to
            # retry, and the ATTACH, still queued, is taken in when Redis answers.
            flat = await asyncio.wait_for(asyncio.shield(reply), self.config.submit_timeout)
        except asyncio.CancelledError:
            reply.add_done_callback(lambda done: self._attached_late(rid, done, client_left=True))
            raise
        except TimeoutError:
            reply.add_done_callback(lambda done: self._attached_late(rid, done, client_left=False))
            raise unavailable(f"Redis did not answer the re-attach to request {rid!r} within "
                              f"{self.config.submit_timeout:g} s; retry", "store") from None
        except Exception as exc:
            self.table.attach_remote(rid, None)
            raise unavailable(f"attaching to request {rid!r} failed ({exc}); retry", "store") from exc
        req = self._state_of(rid, flat)
        found = self.table.get(rid)
        self.table.attach_remote(rid, req)
        if req is None:
            raise unavailable(f"request {rid!r} expired while re-attaching; retry", "expired")
        if found is not None:
            self._same_body(found.digest, digest, rid)
            return found
        return req

    @staticmethod
    def _state_of(rid: str, flat) -> RequestState | None:
        rec = record_from_flat(rid, flat)
        return state_from_record(rec) if rec is not None else None

    def _attached_late(self, rid: str, reply: asyncio.Future, client_left: bool) -> None:
        """An ATTACH answered after its client stopped waiting: the request is taken
        in as any front takes it (else Redis names this router a front of a request
        it does not hold, and its events pile up waiting). A client that left ends
        it as a disconnect ends a request no stream watches; one told to retry
        finds it here."""
        if reply.cancelled() or reply.exception() is not None:
            self.table.attach_remote(rid, None)
            return
        self.table.attach_remote(rid, self._state_of(rid, reply.result()))
        req = self.table.get(rid)
        if client_left and req is not None and req.live and not req.subscribers:
            self.table.cancel(rid, "disconnect")

    def cancel(self, rid: str, source: str) -> bool:
        return self.table.cancel(rid, source)
