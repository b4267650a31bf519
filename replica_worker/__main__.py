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
        # Handlers first: a stop asked for while the engine builds (tens of seconds
        # on a GPU) is a drain of nothing once it is built, not a death by signal.
        built: dict = {}

        def stop() -> None:
            if "worker" in built:
                built["worker"].begin_drain()
            else:
                built["stop"] = True

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        built["worker"] = worker = build_worker(config)
        if built.get("stop"):
            worker.begin_drain()
        await worker.run()

    try:
        asyncio.run(run())
    except FatalRegistrationError as exc:
        logging.error("%s", exc)
        return 2
    except Exception:
        # Anything else: exit non-zero now (its supervisor restarts it) rather than
        # leave the interpreter's teardown waiting on an engine process that lives on;
        # the engine sees its parent gone and ends (engine_process._end_when_orphaned).
        logging.exception("the replica worker failed")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Drained, its engine stopped and joined: the process ends here. The
    # interpreter's teardown (gRPC core's threads, finalizers) has nothing left to
    # do for it and, once, held a drained replica past its stop deadline.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
