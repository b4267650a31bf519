"""--no-prefix-caching reaches the engine's cache config; caching is on by default."""

from replica_worker.engine.config import engine_config
from replica_worker.worker.config import parse_args


def cache_config_of(*flags: str):
    config = parse_args(["--model", "/models/tiny", *flags])
    return engine_config(config.model, scheduler=config.scheduler, **dict(config.engine_args)).cache


def test_prefix_caching_is_on_unless_the_flag_turns_it_off():
    assert cache_config_of().enable_prefix_caching is True
    assert cache_config_of("--no-prefix-caching").enable_prefix_caching is False
