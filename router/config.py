"""Router settings: one frozen, validated dataclass, built from the command line and
environment variables. This is the only place the router reads its environment."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping, Sequence

from router.scheduling.policies.base import PolicySettings

ENV_PREFIX = "QUADRIGA_"
_POLICY_DEFAULTS = PolicySettings()


@dataclass(frozen=True)
class RouterConfig:
    model: str
    port: int = 50051
    host: str = "0.0.0.0"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "quadriga:"
    policy: str = "pull"
    model_name: str = ""
    metrics_port: int = 0              # 0: no metrics HTTP endpoint
    http_port: int = 0                 # OpenAI-compatible HTTP API; 0: off
    http_host: str = ""                # empty: the gRPC host
    http_max_body_mib: float = 64.0    # larger request bodies get 413, unread
    # auto: sampling fields an HTTP request leaves unset take the model's
    # generation_config.json values, as vLLM's OpenAI server does; none: OpenAI's defaults.
    generation_config: str = "auto"
    queue_limit: int = 10_000          # queued (not yet assigned) requests
    no_replica_timeout: float = 30.0   # seconds a request waits for a first replica
    lease_ttl: float = 10.0
    router_lease_ttl: float = 10.0     # a router silent this long is fenced and forgotten
    heartbeat_interval: float = 2.0
    replica_token: str = ""            # shared secret replicas present at Register
    api_keys: str = ""                 # comma-separated client API keys; empty: no check
    tls_cert_file: str = ""            # PEM certificate chain; with tls_key_file: TLS on the gRPC port
    tls_key_file: str = ""
    stream_interval: int = 1           # used when a request asks for 0
    result_ttl: float = 300.0          # finished results stay in Redis this long
    register_timeout: float = 10.0
    redis_timeout: float = 3.0         # deadline of every Redis round trip (then reconnect, retry)
    submit_timeout: float = 5.0        # a new request waits this long to be stored, then UNAVAILABLE
    max_pending_submits: int = 10_000  # submits waiting for Redis before new ones get UNAVAILABLE
    stall_after: float = 0.5           # Redis slower than this: clients are served from memory
    # When a client sees a delta of a request whose replica streams to this router
    # (SHOW_OUTPUT below; docs/router.md, Request states).
    show_output: str = "first_and_finish"
    redis_max_in_flight: int = 1       # write batches sent before the first one's replies are back
    # Milliseconds a batch of middle output only may wait for more deltas to join it
    # (persistence/writer.py: linger); 0: each batch goes as soon as the window is free.
    redis_step_linger_ms: float = 2.0
    # 1: a request that a pop would take at once is assigned as it arrives, its Assign
    # sent while its submit is on the way to Redis, or, for a client's id, once the
    # submit's reply says it was stored (scheduling/pull.py take_at_arrival);
    # 0: every request is stored, then popped.
    take_at_arrival: int = 1
    shutdown_timeout: float = 5.0      # on SIGTERM: time to make pending writes durable
    max_requeues: int = 8              # a request moved this often between replicas fails
    tokenizer_threads: int = 2
    inline_tokenize_chars: int = 512   # prompts this short are tokenized on the event loop
    log_level: str = "INFO"
    # Cache-affine scheduling (docs/router.md): the view of the replicas' caches,
    # pull's choice among the oldest queued requests, cache_aware's balance.
    prefix_index_max_entries: int = 1_000_000   # (replica, block) entries, ~200 bytes each
    prefix_metrics: str = "policy"     # policy: for policies that use the cache; all: every placement
    # The defaults are PolicySettings' (router/scheduling/policies/base.py), which
    # says what each means; they are defined there only.
    pull_affinity_window: int = _POLICY_DEFAULTS.affinity_window
    pull_affinity_max_wait: float = _POLICY_DEFAULTS.affinity_max_wait
    pull_affinity_wait_weight: float = _POLICY_DEFAULTS.affinity_wait_weight
    pull_affinity_balance_abs: int = _POLICY_DEFAULTS.affinity_balance_abs
    pull_affinity_balance_rel: float = _POLICY_DEFAULTS.affinity_balance_rel
    cache_aware_balance_abs: int = _POLICY_DEFAULTS.balance_abs
    cache_aware_balance_rel: float = _POLICY_DEFAULTS.balance_rel

    def __post_init__(self) -> None:
        from router.scheduling.policies import POLICIES

        problems = []
        if not self.model:
            problems.append("model: a model folder is required (--model / QUADRIGA_MODEL)")
        elif not (Path(self.model) / "config.json").exists():
            problems.append(f"model: {self.model} has no config.json")
        if not 0 <= self.port < 65536:
            problems.append(f"port: {self.port} is not a TCP port")
        for name in ("metrics_port", "http_port"):
            if not 0 <= getattr(self, name) < 65536:
                problems.append(f"{name}: {getattr(self, name)} is not a TCP port")
        if not self.http_max_body_mib > 0:
            problems.append(f"http_max_body_mib must be positive, not {self.http_max_body_mib}")
        if self.policy not in POLICIES:
            problems.append(f"policy: {self.policy!r} is not one of {sorted(POLICIES)}")
        if self.take_at_arrival not in (0, 1):
            problems.append(f"take_at_arrival: {self.take_at_arrival} is not 0 or 1")
        if self.generation_config not in ("auto", "none"):
            problems.append(f"generation_config: {self.generation_config!r} is not 'auto' or 'none'")
        if self.show_output not in SHOW_OUTPUT:
            problems.append(f"show_output: {self.show_output!r} is not one of {SHOW_OUTPUT}")
        if self.queue_limit < 1:
            problems.append("queue_limit must be at least 1")
        for name in ("no_replica_timeout", "lease_ttl", "router_lease_ttl", "heartbeat_interval",
                     "result_ttl",
                     "register_timeout", "redis_timeout", "submit_timeout", "stall_after",
                     "shutdown_timeout"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be positive")
        if self.heartbeat_interval >= min(self.lease_ttl, self.router_lease_ttl):
            problems.append("heartbeat_interval must be shorter than lease_ttl and router_lease_ttl")
        if not 1 <= self.stream_interval <= 4096:
            problems.append("stream_interval must lie in [1, 4096]")
        if self.submit_timeout < self.redis_timeout:
            problems.append("submit_timeout must be at least redis_timeout")
        if self.max_pending_submits < 1 or self.max_requeues < 1 or self.redis_max_in_flight < 1:
            problems.append("max_pending_submits, max_requeues and redis_max_in_flight must be at least 1")
        if not 0 <= self.redis_step_linger_ms <= 100:
            problems.append("redis_step_linger_ms must lie in [0, 100]")
        if self.tokenizer_threads < 1:
            problems.append("tokenizer_threads must be at least 1")
        if self.inline_tokenize_chars < 0:
            problems.append("inline_tokenize_chars must be at least 0")
        problems += _affinity_problems(self)
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            problems.append(f"redis_url: {self.redis_url!r} is not a redis:// URL")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            problems.append("TLS needs both tls_cert_file and tls_key_file")
        for name in ("tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                problems.append(f"{name}: {path} is not a readable file")
        if self.api_keys and not self.api_key_set:
            problems.append("api_keys: give comma-separated, non-empty keys")
        if problems:
            raise ValueError("invalid router config: " + "; ".join(problems))

    @property
    def api_key_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())

    def __repr__(self) -> str:
        # Secrets never reach a log line through the config's repr.
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        for secret in SECRET_FIELDS:
            if shown[secret]:
                shown[secret] = "***"
        return "RouterConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    @property
    def served_model_name(self) -> str:
        return self.model_name or Path(self.model).name


SECRET_FIELDS = ("replica_token", "api_keys")
# first_and_finish: a request's first token and its finish as they arrive, the
# deltas between once Redis holds them; on_arrival: every delta as it arrives;
# once_durable: every delta once Redis holds it (while Redis stalls, as it arrives).
SHOW_OUTPUT = ("first_and_finish", "on_arrival", "once_durable")


def _affinity_problems(c: RouterConfig) -> list[str]:
    problems = []
    if c.prefix_index_max_entries < 1:
        problems.append("prefix_index_max_entries must be at least 1")
    if c.prefix_metrics not in ("policy", "all"):
        problems.append(f"prefix_metrics: {c.prefix_metrics!r} is not 'policy' or 'all'")
    if c.pull_affinity_window < 0:
        problems.append("pull_affinity_window must be 0 (off) or more")
    if not c.pull_affinity_max_wait > 0:
        problems.append("pull_affinity_max_wait must be positive")
    if not c.pull_affinity_wait_weight >= 0:
        problems.append("pull_affinity_wait_weight must be 0 or more")
    if c.pull_affinity_balance_abs < 0 or not c.pull_affinity_balance_rel >= 1:
        problems.append("pull_affinity_balance_abs must be 0 (off) or more and "
                        "pull_affinity_balance_rel 1 or more")
    if c.cache_aware_balance_abs < 0 or not c.cache_aware_balance_rel >= 1:
        problems.append("cache_aware_balance_abs must be 0 or more and cache_aware_balance_rel 1 or more")
    return problems


def _env_name(field_name: str) -> str:
    # Names shared with replicas and tools have no ROUTER_ infix.
    special = {"port": "ROUTER_PORT", "host": "ROUTER_HOST", "model": "MODEL",
               "redis_url": "REDIS_URL", "redis_prefix": "REDIS_PREFIX",
               "replica_token": "REPLICA_TOKEN", "api_keys": "API_KEYS",
               "tls_cert_file": "TLS_CERT_FILE", "tls_key_file": "TLS_KEY_FILE"}
    return ENV_PREFIX + special.get(field_name, "ROUTER_" + field_name.upper())


def env_names() -> dict[str, str]:
    """Field name -> environment variable, for the docs and --help."""
    return {f.name: _env_name(f.name) for f in fields(RouterConfig)}


def load_config(argv: Sequence[str] | None = None,
                environ: Mapping[str, str] | None = None) -> RouterConfig:
    """Command-line flags win over environment variables, which win over defaults."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="python -m router", description="Quadriga router")
    for f in fields(RouterConfig):
        env = _env_name(f.name)
        kind = {"int": int, "float": float}.get(str(f.type), str)
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind,
                            default=None, help=f"env {env}")
    args = parser.parse_args(argv)
    values = {}
    for f in fields(RouterConfig):
        value = getattr(args, f.name)
        if value is None and _env_name(f.name) in environ:
            raw = environ[_env_name(f.name)]
            kind = {"int": int, "float": float}.get(str(f.type), str)
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{_env_name(f.name)}={raw!r} is not a valid {kind.__name__}")
        if value is not None:
            values[f.name] = value
    if "model" not in values:
        values["model"] = ""
    return RouterConfig(**values)
