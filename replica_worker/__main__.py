"""python -m replica_worker --router HOST:PORT --model DIR [--device cpu|cuda] [--scheduler NAME]"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from replica_worker.worker.config import parse_args

    config = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s replica {config.replica_id} %(levelname)s %(message)s"
    )
    from replica_worker.worker.app import build_worker
    from replica_worker.worker.client import FatalRegistrationError

    try:
        uvloop = __import__("uvloop")
        uvloop.install()
    except ImportError:
        pass

    async def run() -> None:
        worker = build_worker(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.begin_drain)
        await worker.run()

    try:
        asyncio.run(run())
    except FatalRegistrationError as exc:
        logging.error("%s", exc)
        return 2
    # Drained, its engine stopped and joined: the process ends here. The
    # interpreter's teardown (gRPC core's threads, finalizers) has nothing left to
    # do for it and, once, held a drained replica past its stop deadline.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
