"""The scheduler half of kvxfer's vLLM connector: which requests send or load, and when vLLM may free.

One instance per vLLM engine, in the EngineCore process; it never touches KV memory. It turns vLLM's
scheduler calls into jobs for the workers (:class:`SendJob`, :class:`LoadJob`, aborts), carried in the
step's connector metadata, and keeps the reasons of failed loads for the API server
(:mod:`.outcomes`). Duck-typed on vLLM's ``Request`` (``request_id``, ``prompt_token_ids``,
``kv_transfer_params``, ``status``, ``num_computed_tokens``), so it imports no vLLM module.

Invariants:

* prefill: a finished request with ``do_remote_decode`` is handed to the workers with its blocks and
  its prompt binding, and ``request_finished`` returns ``delay_free=True``: vLLM frees the blocks only
  when every worker reported the request in ``finished_sending`` (the decode's verified RESULT, a
  decode's refusal, or the abandon timeout, ``meta_timeout``);
* decode: a request with ``do_remote_prefill`` loads its whole prompt asynchronously; vLLM keeps it in
  ``WAITING_FOR_REMOTE_KVS`` (and, if it is aborted meanwhile, keeps its blocks) until the workers
  report it in ``finished_recving``, which they do only when kvxfer's request is terminal: verified
  and bound to this prompt, or failed/aborted with the writer's drain proof or a fence;
* a load whose params cannot be used is still handed to the workers, as a failure with its reason,
  so every failure reaches vLLM the same way (``failed_recving``) and the client gets that reason;
* decode, what is checked before any connection, in this order: the params (400 ``invalid_params``),
  the prompt's size and the layout (400 ``size_mismatch``, 500 ``unsupported_layout``), then whether
  this decode trusts every prefill address the params name (:mod:`.trust`: 403 ``untrusted_prefill``).
  A load refused here opens nothing; only a layout refusal is told to the prefill, and only at the
  addresses the decode trusts (the workers filter them);
* prefill: ``request_finished`` builds the client's params before it queues the send, and never
  raises into vLLM: a request whose params cannot be built is not sent (vLLM frees its blocks at once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ...core.arguments import check_rid, shown, split_control_address
from ...errors import ConfigError, InvalidArgument
from .binding import prompt_binding
from .outcomes import LoadFailure, ReasonBook, ReasonServer, reason_address
from .params import ParamsError, TransferParams, parse
from .trust import PrefillTrust

log = logging.getLogger("vllm.kvxfer.scheduler")

SENT_STATES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


@dataclass
class SendJob:
    """Prefill: send the KV of ``request_id`` (``tokens`` prompt tokens in ``block_ids``)."""

    request_id: str
    block_ids: list[int]
    tokens: int
    binding: bytes


@dataclass
class LoadJob:
    """Decode: load the KV named by ``params`` into ``block_ids``, bound to this prompt (``binding``);
    or, with ``failure``, report that failure without loading."""

    request_id: str
    block_ids: list[int]
    tokens: int
    binding: bytes
    params: TransferParams | None = None
    failure: LoadFailure | None = None


@dataclass
class StepJobs:
    """What one scheduler step hands the workers, in order: sends, loads, then aborts."""

    sends: list[SendJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.sends or self.loads or self.aborts)


def pages_for(tokens: int, block_size: int) -> int:
    return -(-int(tokens) // int(block_size))


class SchedulerSide:
    """kvxfer's connector state in vLLM's scheduler (one per engine)."""

    def __init__(self, *, engine_id: str, block_size: int, tp_size: int, producer: bool, consumer: bool,
                 serve_reasons: bool = True, trust: PrefillTrust | None = None) -> None:
        """``trust``: the decode workers' trust settings (:mod:`.trust`), so a load naming a prefill they
        would refuse is refused here; None leaves that to the workers' engines (the same answer, a step later)."""
        self.engine_id, self.block_size, self.tp_size = engine_id, int(block_size), int(tp_size)
        self.producer, self.consumer = producer, consumer
        self.trust = trust
        self.addresses: tuple[str, ...] = ()  # prefill: each TP rank's kvxfer engine (handshake metadata)
        self._jobs = StepJobs()
        self.sending: set[str] = set()  # prefill: handed to workers, not yet in finished_sending
        self.loading: set[str] = set()  # decode: handed to workers, not yet in finished_recving
        self.reasons = ReasonBook()
        self.reason_server = ReasonServer(self.reasons, reason_address(engine_id)) if (consumer and serve_reasons) \
            else None

    # startup -----------------------------------------------------------------------------------------
    def set_addresses(self, by_rank: dict[int, Any]) -> None:
        """The workers' kvxfer addresses, from vLLM's handshake metadata (``{tp_rank: meta}``)."""
        ranks = sorted(by_rank)
        if ranks != list(range(self.tp_size)):
            raise RuntimeError(f"kvxfer: handshake metadata from TP ranks {ranks}, expected 0..{self.tp_size - 1}")
        addresses = tuple(str(by_rank[r].address) for r in ranks)
        for rank, address in enumerate(addresses):
            try:  # what the decode's parser takes: checked once here, so request_finished cannot fail on it
                split_control_address(address, f"TP rank {rank}'s kvxfer address")
            except InvalidArgument as exc:
                raise ConfigError(f"kvxfer: {exc.detail}; a decode could not use it") from None
        self.addresses = addresses

    # decode --------------------------------------------------------------------------------------
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not (self.consumer and isinstance(params, dict) and params.get("do_remote_prefill")):
            return 0, False
        count = len(request.prompt_token_ids or ()) - int(num_computed_tokens)
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not (self.consumer and isinstance(params, dict) and params.get("do_remote_prefill")):
            return
        params["do_remote_prefill"] = False  # one load per request
        if num_external_tokens <= 0:
            return
        rid = str(request.request_id)
        prompt = list(request.prompt_token_ids or ())
        tokens = len(prompt)
        pages = pages_for(tokens, self.block_size)
        job = LoadJob(request_id=rid, block_ids=[int(b) for b in block_ids[:pages]], tokens=tokens,
                      binding=prompt_binding(prompt))
        job.params, job.failure = self._parse(rid, params)
        if job.failure is None:
            job.failure = self._load_problem(job)
        if job.failure is None and self.trust is not None:
            job.failure = self._trust_problem(rid, job.params)
        if job.failure is None and len(job.block_ids) != pages:
            job.failure = LoadFailure(503, "blocks", f"vLLM gave {len(job.block_ids)} blocks for a prompt of "
                                                     f"{tokens} tokens ({pages} blocks of {self.block_size})")
        self._jobs.loads.append(job)
        self.loading.add(rid)

    @staticmethod
    def _parse(rid: str, params: dict[str, Any]) -> tuple[TransferParams | None, LoadFailure | None]:
        """The client's params, or why the load fails. Nothing escapes into vLLM's scheduler: bad params
        are the client's fault (400, naming the field); any other exception would be a kvxfer bug,
        logged, and fails this request only (500)."""
        try:
            return parse(params), None
        except ParamsError as exc:
            return None, LoadFailure(400, "invalid_params", str(exc))
        except Exception as exc:
            log.exception("kvxfer: request %r: reading kv_transfer_params failed", rid)
            return None, LoadFailure(500, "internal_error", f"kvxfer could not read kv_transfer_params: "
                                                            f"{type(exc).__name__}: {shown(str(exc))}")

    def _trust_problem(self, rid: str, params: TransferParams) -> LoadFailure | None:
        """403 ``untrusted_prefill`` when the params name an address this decode does not trust (:mod:`.trust`).
        Like :meth:`_parse`, nothing escapes into vLLM's scheduler: an exception would be a kvxfer bug (500)."""
        assert self.trust is not None
        try:
            return self.trust.refusal(params.addresses)
        except Exception as exc:
            log.exception("kvxfer: request %r: checking the prefill addresses failed", rid)
            return LoadFailure(500, "internal_error", f"kvxfer could not check the prefill addresses: "
                                                      f"{type(exc).__name__}: {shown(str(exc))}")

    def _load_problem(self, job: LoadJob) -> LoadFailure | None:
        """What refuses the load whatever the prefill holds: the prompt's size, unequal TP or block sizes."""
        params = job.params
        assert params is not None
        if params.tokens != job.tokens:
            return LoadFailure(400, "size_mismatch",
                               f"the prompt has {job.tokens} tokens, the KV named by kv_transfer_params (request "
                               f"{params.request_id!r}) was computed for {params.tokens}")
        if params.tp_size != self.tp_size:
            return LoadFailure(500, "unsupported_layout",
                               f"prefill tensor parallel size {params.tp_size} != decode {self.tp_size} "
                               "(kvxfer's vLLM connector needs equal TP sizes for now)")
        if params.block_size != self.block_size:
            return LoadFailure(500, "unsupported_layout",
                               f"prefill block size {params.block_size} != decode {self.block_size} "
                               "(kvxfer's vLLM connector needs equal block sizes for now)")
        return None

    # both ----------------------------------------------------------------------------------------
    def finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: (delay the free?, params for the client)."""
        params = request.kv_transfer_params
        rid = str(request.request_id)
        if self.consumer and rid in self.loading:
            # aborted (or failed) while its load is in flight: vLLM keeps the blocks until the
            # workers report it finished, which they do once the writer drained or was fenced
            self._jobs.aborts.append(rid)
            return False, None
        if not (self.producer and isinstance(params, dict) and params.get("do_remote_decode")):
            return False, None
        status = getattr(getattr(request, "status", None), "name", str(getattr(request, "status", "")))
        if status not in SENT_STATES or not block_ids:
            return False, None  # aborted or failed before its KV was complete: nothing to send
        prompt = list(request.prompt_token_ids or ())
        tokens = len(prompt)
        if int(request.num_computed_tokens) < tokens or not self.addresses:
            return False, None
        try:
            check_rid(rid)  # it travels to the client, the decode and the wire: refused here, not there
        except InvalidArgument as exc:
            log.warning("kvxfer: request %s not sent: %s", shown(rid), exc)
            return False, None
        pages = pages_for(tokens, self.block_size)
        try:  # first the client's params: once the send is queued, nothing here may fail
            out = TransferParams(engine_id=self.engine_id, request_id=rid, addresses=self.addresses, tokens=tokens,
                                 tp_size=self.tp_size, block_size=self.block_size).to_json()
            job = SendJob(request_id=rid, block_ids=[int(b) for b in block_ids[:pages]], tokens=tokens,
                          binding=prompt_binding(prompt))
        except Exception as exc:  # a kvxfer bug: this request is not sent, vLLM frees its blocks, vLLM lives on
            log.error("kvxfer: request %s not sent: its kv_transfer_params could not be built: %s: %s", shown(rid),
                      type(exc).__name__, shown(str(exc)))
            return False, None
        self._jobs.sends.append(job)
        self.sending.add(rid)
        return True, out

    def take_jobs(self) -> StepJobs:
        jobs, self._jobs = self._jobs, StepJobs()
        return jobs

    def on_output(self, finished_sending: Any, finished_recving: Any, reasons: dict[str, LoadFailure]) -> None:
        for rid in finished_sending or ():
            self.sending.discard(rid)
        for rid in finished_recving or ():
            self.loading.discard(rid)
        for rid, failure in reasons.items():
            self.reasons.record(rid, failure)
            log.warning("kvxfer: request %s failed to load (HTTP %d): %s", rid, failure.status, failure.message())

    def pending_push(self) -> bool:
        return bool(self.sending)

    def close(self) -> None:
        if self.reason_server is not None:
            self.reason_server.close()
