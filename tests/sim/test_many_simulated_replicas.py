"""64 simulated replicas in four processes (`python -m replica_worker.sim -k 16`)
register with one real router, and every one of them serves a request."""

from __future__ import annotations

import asyncio
import signal
import sys

from common.pb.quadriga.v1 import generation_pb2 as gpb
from tests.conftest import ROOT
from tests.router.test_scheduling import wait_until
from tests.support.router_harness import client, collect, make_config, running_router, tokens_of
from tests.support.scripted_replica import expected_tokens

PROCESSES, PER_PROCESS = 4, 16
REPLICAS = PROCESSES * PER_PROCESS


async def start_processes(address: str, model, logs) -> list[asyncio.subprocess.Process]:
    # One seat each, so that REPLICAS requests at once need every replica; steps
    # slowed a hundredfold (8 tokens take about 2 s) so that none finishes, and
    # pulls again, before all are placed on a loaded machine.
    return [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "replica_worker.sim", "--router", address, "--model", str(model),
        "--profile", "cpu-tiny", "--replica-id", f"p{i}", "-k", str(PER_PROCESS), "--max-num-seqs", "1",
        "--time-scale", "100", "--drain-timeout", "5", cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=log) for i, log in enumerate(logs)]


def test_sixty_four_simulated_replicas_register_and_all_serve(redis_url, tiny_model, arun, tmp_path):
    paths = [tmp_path / f"sim-{i}.log" for i in range(PROCESSES)]
    logs = [open(p, "wb") for p in paths]

    async def scenario():
        async with running_router(make_config(redis_url, tiny_model, lease_ttl=10.0)) as app:
            procs = await start_processes(app.address, tiny_model, logs)
            try:
                await wait_until(lambda: len(app.registry) == REPLICAS, timeout=120)
                ids = list(app.registry.sessions)
                await wait_until(lambda: all(app.scheduler.credit_of(r) and app.scheduler.credit_of(r).wants_work(0)
                                             for r in ids), timeout=30)
                prompts = [[i + 1, 2 * i + 3] for i in range(REPLICAS)]
                async with client(app.address) as stub:
                    results = await asyncio.gather(*(collect(stub, gpb.GenerateRequest(
                        prompt_token_ids=p, sampling=gpb.SamplingParams(max_tokens=8, ignore_eos=True)),
                        timeout=60) for p in prompts))
            finally:
                for proc in procs:
                    if proc.returncode is None:
                        proc.send_signal(signal.SIGTERM)
                codes = [await asyncio.wait_for(proc.wait(), 30) for proc in procs]
            return sorted(ids), app.limits.vocab_size, prompts, results, codes

    try:
        ids, vocab, prompts, results, codes = arun(scenario(), timeout=240)
    finally:
        for log in logs:
            log.close()
    assert codes == [0] * PROCESSES, [p.read_text()[-2000:] for p in paths]
    assert ids == sorted(f"p{i}-{j}" for i in range(PROCESSES) for j in range(PER_PROCESS))
    for prompt, messages in zip(prompts, results):
        assert tokens_of(messages) == expected_tokens(prompt, 8, vocab)
    assert {m[-1].timings.replica_id for m in results} == set(ids)
