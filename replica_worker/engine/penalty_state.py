"""Token counts of the rows that use penalties, kept on the device between steps.

A slot holds one sequence's count of every token in its output and whether
each token occurs in its prompt. The sampler adds each sampled token to its
slot on the device, so a decode step moves nothing per token. A slot is
(re)built from the sequence's token lists, once, when the sequence first
samples with penalties or when the slot no longer matches it: another
sequence took it, or the counted length differs from the output's (a token
was sampled but never appended). Rows without penalties have no slot and
cost nothing.

Invariant: slot s, owned by sequence q, counts q's first counted[s] output
tokens and marks q's prompt tokens.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, initial_slots: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(initial_slots, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(initial_slots, vocab_size, dtype=torch.bool, device=device)
        self._owner: list[weakref.ref | None] = [None] * initial_slots
        self._counted = [0] * initial_slots
        self._last_step = [0] * initial_slots
        self._key: list[int | None] = [None] * initial_slots  # id() of the owner, its _slot_of key
        self._slot_of: dict[int, int] = {}  # id(sequence) -> slot; checked against _owner
        self._step = 0

    @property
    def num_slots(self) -> int:
        return len(self._owner)

    def assign(self, rows: list) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Slots of these rows, and the host arrays that rebuild the stale ones.

        Rows need prompt_token_ids and output_token_ids and must support weak
        references (a Sequence does). The rebuild arrays travel with the
        step's other inputs; rebuild() applies them on the device.
        """
        self._step += 1
        slots = np.full(len(rows), -1, dtype=np.int64)
        stale: list[int] = []
        # Rows that keep their slot are marked first, so that a new row never takes a slot in use this step.
        for j, row in enumerate(rows):
            slot = self._slot_of.get(id(row))
            if slot is not None and self._owned_by(slot, row):
                slots[j] = slot
                self._last_step[slot] = self._step
                if self._counted[slot] != len(row.output_token_ids):
                    stale.append(j)
        for j in np.flatnonzero(slots < 0).tolist():
            slots[j] = self._take_slot(rows[j])
            stale.append(j)
        for j in stale:
            self._counted[slots[j]] = len(rows[j].output_token_ids)
        for slot in slots.tolist():  # the token sampled this step, added by record()
            self._counted[slot] += 1
        return slots, self._rebuild_arrays([rows[j] for j in stale], slots[stale])

    def _rebuild_arrays(self, rows: list, slots: np.ndarray) -> dict[str, np.ndarray]:
        if not rows:
            return {}
        outs = [np.asarray(r.output_token_ids, dtype=np.int64) for r in rows]
        prompts = [np.asarray(r.prompt_token_ids, dtype=np.int64) for r in rows]
        return {
            "stale_slots": slots.astype(np.int64),
            "out_slots": np.repeat(slots, [len(o) for o in outs]).astype(np.int64),
            "out_tokens": np.concatenate(outs) if outs else np.zeros(0, np.int64),
            "prompt_slots": np.repeat(slots, [len(p) for p in prompts]).astype(np.int64),
            "prompt_tokens": np.concatenate(prompts) if prompts else np.zeros(0, np.int64),
        }

    def rebuild(self, dev: dict[str, torch.Tensor]) -> None:
        """Applies assign()'s rebuild arrays, already on the device."""
        if "stale_slots" not in dev:
            return
        self.counts[dev["stale_slots"]] = 0
        self.in_prompt[dev["stale_slots"]] = False
        ones = torch.ones_like(dev["out_tokens"], dtype=torch.int32)
        self.counts.index_put_((dev["out_slots"], dev["out_tokens"]), ones, accumulate=True)
        self.in_prompt.index_put_((dev["prompt_slots"], dev["prompt_tokens"]),
                                  torch.ones_like(dev["prompt_tokens"], dtype=torch.bool))

    def record(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """Adds this step's sampled tokens (device tensors) to their slots' counts."""
        ones = torch.ones_like(sampled, dtype=torch.int32)
        self.counts.index_put_((slots, sampled), ones, accumulate=True)

    def release(self, row) -> None:
        """The sequence is gone: its slot is free for another."""
        slot = self._slot_of.get(id(row))
        if slot is not None and self._owned_by(slot, row):
            self._free_slot(slot)

    def _owned_by(self, slot: int, row) -> bool:
        ref = self._owner[slot]
        return ref is not None and ref() is row

    def _free_slot(self, slot: int) -> None:
        key = self._key[slot]
        if key is not None and self._slot_of.get(key) == slot:
            del self._slot_of[key]
        self._owner[slot] = None
        self._key[slot] = None

    def _take_slot(self, row) -> int:
        slot = self._reclaimable()
        if slot is None:
            slot = self._grow()
        self._free_slot(slot)
        self._owner[slot] = weakref.ref(row)
        self._key[slot] = id(row)
        self._slot_of[id(row)] = slot
        self._last_step[slot] = self._step
        return slot

    def _reclaimable(self) -> int | None:
        """A free slot, or one whose sequence is gone or did not sample this step."""
        fallback = None
        for slot, owner in enumerate(self._owner):
            if owner is None or owner() is None:
                return slot
            if fallback is None and self._last_step[slot] < self._step:
                fallback = slot
        return fallback

    def _grow(self) -> int:
        old = self.num_slots
        extra = max(old, 1)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.vocab_size)])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(extra, self.vocab_size)])
        self._owner += [None] * extra
        self._key += [None] * extra
        self._counted += [0] * extra
        self._last_step += [0] * extra
        return old
