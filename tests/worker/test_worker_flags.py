"""The replica's environment variables: each is named in --help, switches read
on/off as they are written, and a bad value is a usage error naming its flag
(not a traceback)."""

import pytest

from replica_worker.worker.config import parse_args


def parsed(monkeypatch, env: dict[str, str], *flags: str):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return parse_args(["--model", "/models/tiny", *flags])


@pytest.mark.parametrize("value, on", [("off", False), ("false", False), ("no", False), ("0", False),
                                       ("", False), ("on", True), ("True", True), ("1", True)])
def test_switches_read_as_written(monkeypatch, value, on):
    config = parsed(monkeypatch, {"QUADRIGA_ENGINE_THREAD": value, "QUADRIGA_NO_PREFIX_CACHING": value})
    assert config.engine_thread is on
    assert dict(config.engine_args)["enable_prefix_caching"] is not on


def test_a_flag_turns_a_switch_on_over_its_environment(monkeypatch):
    assert parsed(monkeypatch, {"QUADRIGA_ENGINE_THREAD": "off"}, "--engine-thread").engine_thread


@pytest.mark.parametrize("env, words", [
    ({"QUADRIGA_ASYNC_SCHEDULING": "maybe"}, "--async-scheduling"),
    ({"QUADRIGA_CHUNK_SIZE": "x"}, "--chunk-size"),
    ({"QUADRIGA_ENGINE_THREAD": "sometimes"}, "--engine-thread"),
    ({"QUADRIGA_QUANTIZATION": "int4"}, "--quantization"),
    ({"QUADRIGA_SCHEDULER": "fifo"}, "--scheduler"),
])
def test_a_bad_environment_value_is_a_usage_error(monkeypatch, capsys, env, words):
    with pytest.raises(SystemExit) as stop:
        parsed(monkeypatch, env)
    assert stop.value.code == 2
    assert words in capsys.readouterr().err


def test_help_names_every_flags_environment_variable(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for name in ("QUADRIGA_ROUTER_ADDRESS", "QUADRIGA_NUM_BLOCKS", "QUADRIGA_NO_PREFIX_CACHING",
                 "QUADRIGA_ENGINE_THREAD", "QUADRIGA_REPLICA_METRICS_PORT", "QUADRIGA_TORCH_THREADS"):
        assert name in out.replace("\n", " ").replace("  ", "")


def test_a_flag_wins_over_a_bad_environment_value(monkeypatch):
    config = parsed(monkeypatch, {"QUADRIGA_ASYNC_SCHEDULING": "maybe"}, "--async-scheduling", "off")
    assert dict(config.engine_args)["async_scheduling"] is False
