"""Each step's batch from rank 0 to the other ranks, over the host (gloo) group.

A step is two int64 broadcasts: a fixed header (the counts), then one payload with
every array of the StepBatch back to back. Plain integers, no pickle. Only the
blocks a sequence's context covers this step are sent (a reserving scheduler
allocates for the whole request up front). A header with a negative sequence count
says stop.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from replica_worker.engine.step_batch import StepBatch

_HEADER = 5  # sequences, prefills, tokens, sampled rows, blocks
_STOP = -1


class StepChannel:
    def __init__(self, group: dist.ProcessGroup, block_size: int) -> None:
        self.group = group
        self.block_size = block_size
        self._closed: str | None = None

    def close(self, reason: str) -> None:
        """No more steps: publish raises RuntimeError(reason) from now on."""
        self._closed = reason

    # ---- rank 0 ----
    def publish(self, batch: StepBatch) -> None:
        if self._closed is not None:
            raise RuntimeError(f"this engine's tensor-parallel ranks are stopped: {self._closed}")
        nc = np.asarray(batch.num_computed, dtype=np.int64)
        nt = np.asarray(batch.num_tokens, dtype=np.int64)
        needed = (nc + nt + self.block_size - 1) // self.block_size
        blocks = [np.asarray(ids[:n], dtype=np.int64) for ids, n in zip(batch.block_ids, needed.tolist())]
        flat_blocks = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)
        header = torch.tensor([len(nt), batch.num_prefills, batch.token_ids.size, batch.sample_rows.size,
                               flat_blocks.size], dtype=torch.int64)
        payload = np.concatenate([nc, nt, needed, flat_blocks, batch.token_ids, batch.sample_rows])
        dist.broadcast(header, 0, group=self.group)
        dist.broadcast(torch.from_numpy(payload), 0, group=self.group)

    def publish_stop(self) -> None:
        dist.broadcast(torch.tensor([_STOP] + [0] * (_HEADER - 1), dtype=torch.int64), 0, group=self.group)

    # ---- the other ranks ----
    def receive(self) -> StepBatch | None:
        """Blocks until rank 0 publishes the next step; None when it says stop."""
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        num_seqs, num_prefills, num_tokens, num_samples, num_blocks = header.tolist()
        if num_seqs == _STOP:
            return None
        payload = torch.empty(3 * num_seqs + num_blocks + num_tokens + num_samples, dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.group)
        nc, nt, needed, flat_blocks, token_ids, sample_rows = np.split(
            payload.numpy(), np.cumsum([num_seqs, num_seqs, num_seqs, num_blocks, num_tokens])
        )
        return StepBatch(
            num_computed=nc.tolist(),
            num_tokens=nt.tolist(),
            num_prefills=num_prefills,
            block_ids=np.split(flat_blocks, np.cumsum(needed)[:-1]) if num_seqs else [],
            token_ids=token_ids,
            sample_rows=sample_rows,
        )

    # ---- every rank ----
    def agree_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())
