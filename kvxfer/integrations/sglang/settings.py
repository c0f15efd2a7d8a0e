"""A scheduler rank's :class:`~kvxfer.EngineConfig` under SGLang (importable without SGLang).

Every ``KVXFER_*`` variable is read by :meth:`EngineConfig.from_env`, the one reader; this module
adds what SGLang decides: the context length, the free policy (SGLang owns the bytes of the pages it
reads), the transfer and destination timeouts (SGLang's waiting timeout; the RESULT timeout is never
below it), a drain timeout below SGLang's deferred-release timeout, ``--disaggregation-ib-device``
when no variable names a device, and a per-rank offset on the ports a variable fixed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ...engine.config import EngineConfig
from ...errors import ConfigError

DEFERRED_RELEASE_TIMEOUT = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
WAITING_TIMEOUT = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"


def sglang_float(environ: Mapping[str, str], name: str, default: float) -> float:
    """One of SGLang's own timeouts, as SGLang reads it (a bad value: the default)."""
    try:
        return float(environ.get(name, default))
    except ValueError:
        return default


def engine_config(server_args: Any, pool_tokens: int, rank: int,
                  environ: Mapping[str, str] | None = None) -> EngineConfig:
    """kvxfer settings for scheduler rank ``rank``, from SGLang's arguments and ``KVXFER_*`` variables."""
    env = os.environ if environ is None else environ
    context = getattr(server_args, "context_length", None) or pool_tokens
    deferred_timeout = sglang_float(env, DEFERRED_RELEASE_TIMEOUT, 30.0)
    waiting_timeout = sglang_float(env, WAITING_TIMEOUT, 300.0)
    config = EngineConfig.from_env(
        env,
        max_context=int(context),
        free_policy="keep",  # SGLang owns the bytes of pages it reads; kvxfer never rewrites them
        transfer_timeout=waiting_timeout,
        meta_timeout=waiting_timeout,
    )
    changes: dict[str, Any] = {
        # Fence before SGLang's deferred-release timeout could free a page kvxfer still guards.
        "drain_timeout": max(0.5, min(config.drain_timeout, deferred_timeout / 2)),
        # An honest decode answers RESULT within its transfer timeout (SGLang's waiting timeout).
        "result_timeout": max(config.result_timeout, waiting_timeout),
    }
    for name in ("metrics_port", "control_port", "data_port"):  # rank r serves on KVXFER_<NAME> + r
        port = getattr(config, name)
        if port:
            if port + rank > 65535:
                raise ConfigError(f"KVXFER_{name.upper()}={port} plus rank {rank} is not a TCP port")
            changes[name] = port + rank
    device = getattr(server_args, "disaggregation_ib_device", None)
    if device and config.options("verbs").device is None:
        verbs = config.transport_options.get("verbs")
        verbs = dataclasses.asdict(verbs) if dataclasses.is_dataclass(verbs) else dict(verbs or {})
        changes["transport_options"] = {**config.transport_options, "verbs": {**verbs, "device": device}}
    return dataclasses.replace(config, **changes)
