"""python -m replica_worker.sim --router HOST:PORT --replica-id ID --profile h200-8b [-k K] [...]

K simulated replicas in this process, each its own router stream and identity
(ID-0 .. ID-K-1 when K > 1). SIGTERM or Ctrl-C drains them all.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from replica_worker.sim.config import parse_args

    try:
        config = parse_args(argv)
    except ValueError as exc:  # a bad setting: say which, without a traceback
        print(f"python -m replica_worker.sim: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s sim {config.replica_id} %(levelname)s %(message)s")
    from replica_worker.sim.replicas import build_workers, run_workers
    from replica_worker.worker.client import FatalRegistrationError

    try:
        __import__("uvloop").install()
    except ImportError:
        pass

    async def run() -> None:
        workers = build_workers(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: [w.begin_drain() for w in workers])
        await run_workers(workers)

    try:
        asyncio.run(run())
    except (FatalRegistrationError, ValueError) as exc:  # refused, or an unknown profile
        logging.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
