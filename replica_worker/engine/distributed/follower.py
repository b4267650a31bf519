"""A tensor-parallel rank other than 0: its shard of the model, following rank 0's steps.

    python -m replica_worker.engine.distributed.follower --rank R --size N --store-port P \
        --device DEV --life-fd FD --config JSON

Started by rank 0 (leader.py), never by hand. It holds no sequences, no scheduler and no
sampler: each step it receives rank 0's batch, runs the forward on its heads' KV cache
(the block ids rank 0's block manager chose) and takes part in the collectives. It exits
when rank 0 says stop (over the step channel, then both leave the process group), or
when rank 0 dies (the pipe from it reaches EOF). An error here ends this process, and
rank 0 exits on seeing it go.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

log = logging.getLogger("replica_worker.tp_follower")

STOP = b"stop"  # rank 0 writes it to the pipe on a deliberate stop: exit quietly


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m replica_worker.engine.distributed.follower")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--life-fd", type=int, required=True)
    p.add_argument("--config", required=True)
    return p.parse_args(argv)


def _exit_with_leader(fd: int, rank: int) -> None:
    said = os.read(fd, len(STOP))  # blocks until rank 0 writes or its end closes
    if said == STOP:
        os._exit(0)
    log.error("rank 0 exited or gave up on the ranks; tensor-parallel rank %d exits with it", rank)
    logging.shutdown()
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # A stop is rank 0's to run (a worker drains on SIGTERM or Ctrl-C): a rank that
    # died of a signal sent to the whole process group (systemd, a terminal) would
    # end the replica mid-drain. It ends with rank 0 (_exit_with_leader).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp rank {args.rank} %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_leader, args=(args.life_fd, args.rank), daemon=True).start()

    import torch
    import torch.distributed as dist

    from replica_worker.engine.config import EngineConfig
    from replica_worker.engine.distributed.group import RankContext
    from replica_worker.engine.distributed.step_channel import StepChannel
    from replica_worker.engine.distributed.torch_group import join, leave
    from replica_worker.engine.model_runner import ModelRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig.from_dict(json.loads(args.config))
    store = dist.TCPStore("127.0.0.1", args.store_port, args.size, is_master=False)
    tensors, host = join(args.rank, args.size, store, torch.device(args.device))
    channel = StepChannel(host, config.cache.block_size)
    runner = ModelRunner(config, RankContext(tensors, args.device, channel))
    log.info("ready on %s with %d KV blocks; following rank 0", args.device, runner.num_blocks)
    while (batch := channel.receive()) is not None:
        runner.run_batch(batch, None)
    leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
