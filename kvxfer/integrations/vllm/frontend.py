"""The API server's half: a failed kvxfer load answers with its own status and reason, not a bare 500.

vLLM's OpenAI server turns ``finish_reason="error"`` into HTTP 500 "Internal server error"
(``GenerateBaseServing._raise_if_error``). :func:`install` wraps that method in the API server process:
for an engine whose connector is kvxfer's, it asks the engine's scheduler connector why the request
failed (:func:`.outcomes.ask_reason`, a local socket, at most one second, only on that error path) and
raises a 400 (``BadRequestError``, the request's fault), another 4xx (403 for a prefill the decode does not
trust: vLLM's ``GracefulHTTPError``, which carries its status) or a 5xx with kvxfer's reason instead.
Requests kvxfer recorded nothing for keep vLLM's own answer. Idempotent.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from .outcomes import ask_reason, reason_address

log = logging.getLogger("vllm.kvxfer.frontend")
_MARK = "_kvxfer_wrapped"
CONNECTOR = "KvxferConnector"


def _engine_id(serving: Any) -> str | None:
    config = getattr(getattr(serving, "engine_client", None), "vllm_config", None)
    transfer = getattr(config, "kv_transfer_config", None)
    if transfer is None or getattr(transfer, "kv_connector", None) != CONNECTOR:
        return None
    return str(transfer.engine_id)


def install() -> bool:
    """Wrap ``GenerateBaseServing._raise_if_error`` (True if it is wrapped now)."""
    try:
        from vllm.entrypoints.generate.base import serving
        from vllm.exceptions import GenerationError, GracefulHTTPError, VLLMValidationError
    except ImportError as exc:  # another vLLM layout: keep vLLM's 500
        log.warning("kvxfer: cannot map load failures to HTTP statuses in this vLLM: %s", exc)
        return False
    cls = serving.GenerateBaseServing
    original = cls._raise_if_error
    if getattr(original, _MARK, False):
        return True

    class KvxferRequestRefused(VLLMValidationError):
        """kvxfer refused the request's KV (its params, its prompt): HTTP 400."""

    class KvxferRequestForbidden(GracefulHTTPError):
        """kvxfer refused the request with a 4xx other than 400 (403: a prefill the decode does not trust)."""

        def __init__(self, message: str, status: int) -> None:
            super().__init__(message, HTTPStatus(status))

    class KvxferLoadFailed(GenerationError):
        """A peer failed to deliver the request's KV: HTTP 5xx with kvxfer's reason."""

        def __init__(self, message: str, status: int) -> None:
            super().__init__(message)
            self.status_code = HTTPStatus(status)

    def _raise_if_error(self: Any, finish_reason: str | None, request_id: str) -> None:
        if finish_reason == "error":
            engine_id = _engine_id(self)
            failure = ask_reason(reason_address(engine_id), request_id) if engine_id else None
            if failure is not None:
                log.warning("request %s: %s", request_id, failure.message())
                if failure.status == 400:
                    raise KvxferRequestRefused(failure.message(), parameter="kv_transfer_params")
                if 400 < failure.status < 500:
                    raise KvxferRequestForbidden(failure.message(), failure.status)
                raise KvxferLoadFailed(failure.message(), failure.status)
        return original(self, finish_reason, request_id)

    setattr(_raise_if_error, _MARK, True)
    _raise_if_error.__wrapped__ = original  # type: ignore[attr-defined]
    cls._raise_if_error = _raise_if_error
    return True
