"""Tensor parallelism's processes and collectives.

group.py is all the model's layers see (a rank, a size, all-reduce, all-gather); a
single-process engine uses its SingleRank and never imports the rest of this package.
torch_group.py joins the ranks with torch.distributed (NCCL on CUDA, gloo on the CPU),
step_channel.py carries each step's batch from rank 0 to the others, leader.py starts
and watches ranks 1..N-1 from rank 0, follower.py is their main.
"""
