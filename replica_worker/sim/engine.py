"""A simulated replica engine: EngineCore with SimulatedRunner in place of the model.

Everything but the model is the real engine: the scheduler (any of the five),
the block manager with prefix caching (so admission capacity, pull credit,
preemption, cache hits and KV events are what a real replica of that KV size
would report), request validation, stop conditions and the incremental
detokenizer. Tokens follow runner.rule_token; their text is f"<{token}>", so
stop strings work without a tokenizer. Sampling settings other than stops
and max_tokens have no effect: there are no logits to sample from.
"""

from __future__ import annotations

from replica_worker.engine.config import EngineConfig, engine_config
from replica_worker.engine.core import EngineCore
from replica_worker.sim.cost_model import Profile
from replica_worker.sim.runner import SimulatedRunner
from replica_worker.sim.shared_device import SharedDevice


class RuleTokenizer:
    """Decodes any token id to f"<{id}>": what the detokenizer needs of a tokenizer."""

    eos_token_id = None

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{t}>" for t in token_ids)


def simulated_engine_config(profile: Profile, scheduler: str = "sarathi", **engine_kwargs) -> EngineConfig:
    """An EngineConfig as the worker builds one (same flat arguments), sized by the
    profile where not told otherwise: its KV blocks (the same KV memory when the
    block size differs) and its length limit."""
    kwargs = dict(engine_kwargs)
    block_size = kwargs.setdefault("block_size", profile.block_size)
    kwargs.setdefault("num_blocks", profile.num_kv_blocks * profile.block_size // block_size)
    kwargs.setdefault("max_model_len", profile.max_model_len)
    for model_only in ("dtype", "load_format", "seed", "quantization", "gpu_memory_utilization", "kv_cache_memory_bytes"):
        kwargs.pop(model_only, None)
    return engine_config(f"simulated:{profile.name}", scheduler=scheduler, **kwargs)


class SimulatedEngine(EngineCore):
    """Same interface and behaviour as EngineCore; only the runner differs."""

    def __init__(self, config: EngineConfig, runner: SimulatedRunner):
        super().__init__(config, RuleTokenizer(), runner=runner)
        self._had_work = False

    def step(self):
        # A step right after one that left work (the engine loop does not wait
        # between them) is one whose host work a real async engine overlaps.
        self.runner.follows_previous(self._had_work)
        result = super().step()
        if not result.batch_size:
            self.runner.idle()
        self._had_work = self.has_unfinished()
        return result

    @classmethod
    def from_profile(cls, profile: Profile, scheduler: str = "sarathi", *, vocab_size: int | None = None,
                     eos_token_id: int | None = None, time_scale: float = 1.0, record: bool = False,
                     shared_device: SharedDevice | None = None, overlap: bool = False,
                     **engine_kwargs) -> "SimulatedEngine":
        config = simulated_engine_config(profile, scheduler, **engine_kwargs)
        runner = SimulatedRunner(
            profile.cost, num_blocks=config.cache.num_blocks, max_model_len=config.model.max_model_len,
            vocab_size=vocab_size or profile.vocab_size,
            eos_token_id=eos_token_id,
            time_scale=time_scale, record=record, shared_device=shared_device, overlap=overlap)
        return cls(config, runner)
