import asyncio

import pytest


@pytest.fixture
def arun():
    """Runs a coroutine to completion on a fresh event loop, with a safety timeout."""

    def run(coro, timeout: float = 60):
        return asyncio.run(asyncio.wait_for(coro, timeout))

    return run
