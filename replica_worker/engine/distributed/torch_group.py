"""The ranks of one tensor-parallel engine joined by torch.distributed.

The model's tensors travel over NCCL on CUDA (its all-reduce and all-gather are
captured in the decode CUDA graphs like any kernel) and over gloo on the CPU. Host-side
messages (each step's batch, the agreed KV block count) always travel over a gloo
group, so sending them never waits on a GPU. The groups are the process's default
torch.distributed world: one tensor-parallel engine per process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from replica_worker.engine.distributed.group import TensorGroup


class TorchTensorGroup(TensorGroup):
    def __init__(self, group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.group = group
        self.rank = rank
        self.size = size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, x, group=self.group)
        return out


def join(rank: int, size: int, store: dist.Store, device: torch.device) -> tuple[TorchTensorGroup, dist.ProcessGroup]:
    """This process as `rank` of `size`: the tensor group and the host-message group.
    Blocks until every rank has joined."""
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    # device_id makes NCCL build its communicator now, before any CUDA graph capture.
    dist.init_process_group("nccl" if on_gpu else "gloo", store=store, rank=rank, world_size=size,
                            device_id=device if on_gpu else None)
    world = dist.group.WORLD
    host = dist.new_group(backend="gloo") if on_gpu else world
    return TorchTensorGroup(world, rank, size), host


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
