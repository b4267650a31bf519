"""--threads (QUADRIGA_TORCH_THREADS): unset, an accelerator's engine gets one
torch thread (its host work is one Python thread; idle intra-op threads only
contend with the worker and router), the CPU's all of torch's default."""

from replica_worker.worker.config import parse_args


def threads_of(*flags: str) -> int:
    return parse_args(["--router", "127.0.0.1:1", "--model", "/models/tiny", *flags]).engine_threads


def test_engine_threads_default_by_device_and_follow_the_flag(monkeypatch):
    assert threads_of() == 0                       # cpu: torch's default
    assert threads_of("--device", "cuda") == 1
    assert threads_of("--device", "cuda:1") == 1
    assert threads_of("--device", "cuda", "--threads", "4") == 4
    assert threads_of("--threads", "2") == 2
    monkeypatch.setenv("QUADRIGA_TORCH_THREADS", "3")
    assert threads_of("--device", "cuda") == 3
