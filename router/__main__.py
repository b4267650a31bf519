"""python -m router --port P --redis-url URL --policy NAME --model DIR ..."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from router.config import load_config
from router.server import serve


def main(argv=None) -> int:
    try:
        config = load_config(argv)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))
    return 0


def exit_now(code: int) -> None:
    """After a stop, everything is durable and every stream has ended: skip the
    interpreter's teardown of torch and transformers (over a second), so a
    successor router takes over sooner."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
