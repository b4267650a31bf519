"""--tensor-parallel-size (or QUADRIGA_TENSOR_PARALLEL_SIZE) reaches the engine, and a
failed step of a tensor-parallel engine ends the replica instead of being retried."""

import asyncio

import pytest

from replica_worker.engine.config import engine_config
from replica_worker.worker.config import parse_args
from tests.worker.fakes import FakeEngine, Wired, assignment, make_worker
from tests.worker.test_worker import assign


def parallel_config_of(*flags: str):
    config = parse_args(["--model", "/models/tiny", *flags])
    return engine_config(config.model, scheduler=config.scheduler, **dict(config.engine_args)).parallel


def test_the_flag_and_the_environment_set_the_tensor_parallel_size(monkeypatch):
    assert parallel_config_of().tensor_parallel_size == 1
    assert parallel_config_of("--tensor-parallel-size", "2").tensor_parallel_size == 2
    monkeypatch.setenv("QUADRIGA_TENSOR_PARALLEL_SIZE", "4")
    assert parallel_config_of().tensor_parallel_size == 4
    assert parallel_config_of("--tensor-parallel-size", "2").tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        parallel_config_of("--tensor-parallel-size", "0")


def test_a_failed_tensor_parallel_step_ends_the_replica():
    """The other ranks may be waiting inside a collective of the failed step: retrying
    would pair the next step's collectives with theirs, so the replica exits (the router
    requeues its requests) even for an error one rank could recover from."""
    async def main():
        engine = FakeEngine(seats=4, length=3)
        engine.step_errors_recoverable = False
        worker = make_worker(engine)
        failures = []
        worker.engine_loop._on_device_failure = failures.append  # instead of os._exit
        async with Wired(worker):
            engine.fail_steps = 1
            assign(worker, assignment("a"))
            for _ in range(100):
                if failures:
                    break
                await asyncio.sleep(0.02)
        assert [str(e) for e in failures] == ["boom in step"]
        assert "a" in worker.book.live, "the request is the router's to requeue, not failed here"
    asyncio.run(main())
