"""Token counts of the rows that use penalties, kept on the device between steps.

A slot holds one sequence's count of every token in its output and whether
each token occurs in its prompt. The sampler adds each sampled token to its
slot on the device, so a decode step moves nothing per token. A slot is
(re)built from the sequence's token lists, once, when the sequence first
samples with penalties or when the slot no longer matches it: the counted
length differs from the output's (a token was sampled but never appended).
Rows without penalties have no slot and cost nothing.

Invariant: slot s, owned by the live object whose id() is key[s], counts
its first counted[s] output tokens and marks its prompt tokens. A weak
reference's callback frees the slot when its owner dies, before CPython can
give that id() to another object, so a key match means the same owner.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

_FREE = -1


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, initial_slots: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # float32, so penalties apply with fused multiply-adds; exact up to 2**24 of a token.
        self.counts = torch.zeros(initial_slots, vocab_size, dtype=torch.float32, device=device)
        self.in_prompt = torch.zeros(initial_slots, vocab_size, dtype=torch.bool, device=device)
        self._key = np.full(initial_slots, _FREE, dtype=np.int64)  # id() of each slot's owner
        self._counted = np.zeros(initial_slots, dtype=np.int64)
        self._last_step = np.zeros(initial_slots, dtype=np.int64)
        self._refs: list[weakref.ref | None] = [None] * initial_slots
        self._slot_of: dict[int, int] = {}  # id(owner) -> slot
        self._step = 0

    @property
    def num_slots(self) -> int:
        return len(self._key)

    def assign(self, rows: list) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Slots of these rows, and the host arrays that rebuild the stale ones.

        Rows need prompt_token_ids and output_token_ids and must support weak
        references (a Sequence does). The rebuild arrays travel with the
        step's other inputs; rebuild() applies them on the device. The
        token sampled this step is counted as appended: record() adds it.
        """
        self._step += 1
        keys = [id(r) for r in rows]
        slots = np.fromiter((self._slot_of.get(k, _FREE) for k in keys), dtype=np.int64, count=len(rows))
        lengths = np.fromiter((len(r.output_token_ids) for r in rows), dtype=np.int64, count=len(rows))
        known = slots != _FREE
        self._last_step[slots[known]] = self._step  # before any new row looks for a slot
        stale = np.flatnonzero(known & (self._counted[np.where(known, slots, 0)] != lengths))
        new = np.flatnonzero(~known)
        for j in new.tolist():
            slots[j] = self._take_slot(rows[j])
        self._counted[slots] = lengths + 1
        rebuild = np.concatenate([stale, new])
        return slots, self._rebuild_arrays([rows[j] for j in rebuild.tolist()], slots[rebuild])

    def _rebuild_arrays(self, rows: list, slots: np.ndarray) -> dict[str, np.ndarray]:
        if not rows:
            return {}
        outs = [np.asarray(r.output_token_ids, dtype=np.int64) for r in rows]
        prompts = [np.asarray(r.prompt_token_ids, dtype=np.int64) for r in rows]
        return {
            "stale_slots": slots,
            "out_slots": np.repeat(slots, [len(o) for o in outs]),
            "out_tokens": np.concatenate(outs),
            "prompt_slots": np.repeat(slots, [len(p) for p in prompts]),
            "prompt_tokens": np.concatenate(prompts),
        }

    def rebuild(self, dev: dict[str, torch.Tensor]) -> None:
        """Applies assign()'s rebuild arrays, already on the device."""
        if "stale_slots" not in dev:
            return
        # index_fill_ takes its value as a kernel argument; assigning a Python
        # scalar through advanced indexing would copy it from host memory and
        # synchronize the stream.
        self.counts.index_fill_(0, dev["stale_slots"], 0.0)
        self.in_prompt.index_fill_(0, dev["stale_slots"], False)
        ones = torch.ones_like(dev["out_tokens"], dtype=torch.float32)
        self.counts.index_put_((dev["out_slots"], dev["out_tokens"]), ones, accumulate=True)
        self.in_prompt.index_put_((dev["prompt_slots"], dev["prompt_tokens"]),
                                  torch.ones_like(dev["prompt_tokens"], dtype=torch.bool))

    def record(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """Adds this step's sampled tokens (device tensors) to their slots' counts."""
        self.counts.index_put_((slots, sampled), torch.ones_like(sampled, dtype=torch.float32), accumulate=True)

    def release(self, row) -> None:
        """The sequence has left: its slot is free for another."""
        slot = self._slot_of.get(id(row))
        if slot is not None:
            self._free(slot, id(row))

    def _free(self, slot: int, key: int) -> None:
        if self._key[slot] == key:
            self._slot_of.pop(key, None)
            self._key[slot] = _FREE
            self._refs[slot] = None

    def _take_slot(self, row) -> int:
        free = np.flatnonzero(self._key == _FREE)
        if not len(free):  # a slot whose owner did not sample this step is rebuilt if it returns
            free = np.flatnonzero(self._last_step < self._step)
        slot = int(free[0]) if len(free) else self._grow()
        if self._key[slot] != _FREE:
            self._free(slot, int(self._key[slot]))
        key = id(row)
        self._key[slot] = key
        self._refs[slot] = weakref.ref(row, lambda _, s=slot, k=key: self._free(s, k))
        self._slot_of[key] = slot
        self._last_step[slot] = self._step
        return slot

    def _grow(self) -> int:
        old = self.num_slots
        extra = max(old, 1)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.vocab_size)])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(extra, self.vocab_size)])
        self._key = np.concatenate([self._key, np.full(extra, _FREE, dtype=np.int64)])
        self._counted = np.concatenate([self._counted, np.zeros(extra, dtype=np.int64)])
        self._last_step = np.concatenate([self._last_step, np.zeros(extra, dtype=np.int64)])
        self._refs += [None] * extra
        return old
