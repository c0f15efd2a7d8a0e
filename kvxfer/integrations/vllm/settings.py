"""A vLLM worker's :class:`~kvxfer.EngineConfig` (importable without vLLM).

Every ``KVXFER_*`` variable is read by :meth:`EngineConfig.from_env`, the one reader. On top of it:

* ``kv_connector_extra_config`` may set any :class:`EngineConfig` field by name (it wins over the
  variable: it is the deployment's own file); an unknown key is a :class:`ConfigError` naming the keys
  it accepts;
* vLLM decides the context (``--max-model-len``) and the free policy (``keep``: vLLM owns the bytes of
  the blocks it reads, kvxfer never rewrites them);
* a port a variable or the extra config fixed is offset by the worker's TP rank (rank r binds port + r).

Prefill timeouts that matter here: ``meta_timeout`` (``KVXFER_META_TIMEOUT``, 60 s) is how long a
prefill keeps a finished request's blocks for a decode that never comes (an abandoned prefill); the
decode's ``transfer_timeout`` (``KVXFER_TRANSFER_TIMEOUT``, 60 s) bounds a load, after which its blocks
wait for the writer's drain proof or a fence (``drain_timeout``, 10 s) before vLLM gets them back.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ...engine.config import EngineConfig
from ...errors import ConfigError

FIXED_BY_VLLM = ("max_context", "free_policy", "unsafe_legacy")


def engine_config(max_model_len: int, extra: Mapping[str, Any] | None, rank: int,
                  environ: Mapping[str, str] | None = None) -> EngineConfig:
    """kvxfer settings for TP rank ``rank`` of a vLLM engine with context ``max_model_len``."""
    env = os.environ if environ is None else environ
    names = {f.name for f in dataclasses.fields(EngineConfig)} - set(FIXED_BY_VLLM)
    overrides = dict(extra or {})
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown kvxfer setting(s) {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(names))}; {', '.join(FIXED_BY_VLLM)} are vLLM's)")
    config = EngineConfig.from_env(env, **overrides, max_context=int(max_model_len), free_policy="keep")
    changes: dict[str, Any] = {}
    for name in ("metrics_port", "control_port", "data_port"):
        port = getattr(config, name)
        if port and rank:
            if port + rank > 65535:
                raise ConfigError(f"kvxfer {name} {port} plus TP rank {rank} is not a TCP port")
            changes[name] = port + rank
    return dataclasses.replace(config, **changes) if changes else config
