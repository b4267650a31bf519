"""python -m router --port P --redis-url URL --policy NAME --model DIR ..."""

from __future__ import annotations

import asyncio
import logging
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


if __name__ == "__main__":
    sys.exit(main())
