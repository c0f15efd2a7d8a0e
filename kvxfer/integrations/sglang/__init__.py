"""kvxfer as a drop-in SGLang disaggregation transfer backend (``--disaggregation-transfer-backend kvxfer``).

:func:`register` is kvxfer's entry point in SGLang's plugin group ``sglang.srt.plugins``
(pyproject.toml): SGLang calls it in ``launch_server`` before parsing arguments and again in every
process it spawns (schedulers, detokenizer, DP controller). It adds ``kvxfer`` to SGLang's backend
enum and argument choices, routes ``get_kv_class`` to :mod:`.conn`'s classes, and registers two hooks
through SGLang's hook registry: an abort whose reason is a kvxfer admission refusal (a prompt that
can never fit, see :data:`ADMISSION_REFUSED`) answers the client with HTTP 400, not 500, and one
whose prefill the decode does not trust (:data:`UNTRUSTED_PREFILL`) with HTTP 403; and
``Scheduler.run_batch`` of a kvxfer prefill sends each layer's KV as the forward computes it
(:mod:`.layerwise`; ``KVXFER_LAYERWISE=0`` turns it off). This module
imports SGLang only when :func:`register` is called; :mod:`.conn` imports it at import time.
``SGLANG_PLUGINS`` (SGLang's whitelist of plugin names) can leave it out.

Tested against: sglang 0.5.23 (:data:`TESTED_VERSIONS`).
"""

from __future__ import annotations

import sys
from typing import Any

from .reasons import ADMISSION_REFUSED, UNTRUSTED_PREFILL

BACKEND = "kvxfer"
TESTED_VERSIONS = ("0.5.23",)
_MARK = "_kvxfer_wrapped"
_PREPARE_ABORT = "sglang.srt.disaggregation.utils.prepare_abort"
_RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"


def _admission_refusals_are_client_errors(original: Any, req: Any, error_message: str, status_code: Any = None) -> Any:
    """SGLang aborts every failed transfer with 500; a prompt kvxfer refused at admission (longer
    than a pool can ever hold) is the client's to fix: 400, with kvxfer's reason in the message; a
    request naming a prefill the decode does not trust (its bootstrap address is the client's or the
    router's choice) is refused, not retried: 403, as the vLLM connector answers ``untrusted_prefill``."""
    from http import HTTPStatus

    if UNTRUSTED_PREFILL in str(error_message):
        status_code = HTTPStatus.FORBIDDEN
    elif ADMISSION_REFUSED in str(error_message):
        status_code = HTTPStatus.BAD_REQUEST
    return original(req, error_message, status_code=status_code)


def _layerwise_run_batch(original: Any, *args: Any, **kwargs: Any) -> Any:
    """``Scheduler.run_batch`` with kvxfer's layer-wise sends around a prefill's extend batch
    (:mod:`.layerwise`; a batch of any other scheduler runs as it is)."""
    from .layerwise import around_run_batch

    return around_run_batch(original, *args, **kwargs)


def _extend_enum(enum_cls: Any, name: str, value: str) -> Any:
    """Add a member to an existing Enum (idempotent)."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member.__init__(value)
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def register() -> None:
    """Make ``kvxfer`` a transfer backend of the SGLang in this process (idempotent)."""
    import sglang
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(hook is _admission_refusals_are_client_errors for _, hook, _ in HookRegistry._hooks.get(_PREPARE_ABORT, [])):
        HookRegistry.register(_PREPARE_ABORT, _admission_refusals_are_client_errors, HookType.AROUND)
    if not any(hook is _layerwise_run_batch for _, hook, _ in HookRegistry._hooks.get(_RUN_BATCH, [])):
        HookRegistry.register(_RUN_BATCH, _layerwise_run_batch, HookType.AROUND)
    version = getattr(sglang, "__version__", "?")
    if version not in TESTED_VERSIONS:
        import warnings

        warnings.warn(f"kvxfer's SGLang backend was tested with sglang {', '.join(TESTED_VERSIONS)}, "
                      f"this is {version}", RuntimeWarning, stacklevel=2)
    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
    member = _extend_enum(utils.TransferBackend, "KVXFER", BACKEND)
    original = utils.get_kv_class
    if getattr(original, _MARK, False):
        return

    def get_kv_class(transfer_backend: Any, class_type: Any, *args: Any, **kwargs: Any) -> Any:
        if transfer_backend == member and class_type != utils.KVClassType.KVARGS:
            from . import conn

            return {
                utils.KVClassType.MANAGER: conn.KvxferKVManager,
                utils.KVClassType.SENDER: conn.KvxferKVSender,
                utils.KVClassType.RECEIVER: conn.KvxferKVReceiver,
                utils.KVClassType.BOOTSTRAP_SERVER: conn.KvxferKVBootstrapServer,
            }.get(class_type)
        return original(transfer_backend, class_type, *args, **kwargs)

    setattr(get_kv_class, _MARK, True)
    get_kv_class.__wrapped__ = original  # type: ignore[attr-defined]
    utils.get_kv_class = get_kv_class
    # modules that did `from ...utils import get_kv_class` before this call
    for name, module in list(sys.modules.items()):
        if name.startswith("sglang.") and getattr(module, "get_kv_class", None) is original:
            module.get_kv_class = get_kv_class
