"""Settings of simulated replicas: identities, what --model says, and clear errors."""

import pytest

from replica_worker.sim.config import parse_args
from replica_worker.sim.cost_model import load_profile


def test_replicas_take_numbered_identities_and_the_model_folders_facts(tiny_model):
    config = parse_args(["--router", "h:1", "--replica-id", "x", "-k", "3", "--model", str(tiny_model),
                         "--metrics-port", "9000"])
    assert config.replica_ids() == ["x-0", "x-1", "x-2"]
    assert [config.worker_config(i).metrics_port for i in range(3)] == [9000, 9001, 9002]
    assert config.model_name == tiny_model.name and config.eos_token_id == 2
    assert parse_args(["--router", "h:1", "--replica-id", "x"]).replica_ids() == ["x"]


def test_async_scheduling_reaches_every_replicas_runner(tiny_model):
    from replica_worker.sim.replicas import build_engine

    for argv, overlap in (([], False), (["--async-scheduling"], True)):
        config = parse_args(["--router", "h:1", "--model", str(tiny_model), *argv])
        assert config.async_scheduling is overlap
        assert build_engine(config, load_profile(config.profile, config.profiles_file)).runner.overlap is overlap


@pytest.mark.parametrize("argv, message", [
    (["--router", "nohostport"], "HOST:PORT"),
    (["--router", "h:1", "-k", "0"], "at least 1"),
    (["--router", "h:1", "--time-scale", "-1"], "non-negative"),
])
def test_bad_settings_say_what_is_wrong(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_args(argv)


def test_an_unknown_profile_names_the_known_ones():
    with pytest.raises(ValueError, match="h200-8b"):
        load_profile("no-such-profile")
