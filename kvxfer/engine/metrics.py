"""Prometheus metrics of one engine, served on ``EngineConfig.metrics_port`` (off by default).

What an operator sees (every name starts ``kvxfer_``, every series carries ``role``):

- ``transfers_total{outcome}``: requests by terminal state (``RELEASED``, ``SUCCEEDED``,
  ``REJECTED``, ``ABORTED``, ``FAILED``) and ``transfer_seconds``: admission to verified (decode)
  or admission to the receiver's verdict (prefill), a histogram;
- ``bytes_total{direction}``: bytes landed (decode) or posted (prefill); ``layer_sends_total``
  (prefill): sends of some buffers only (layer-wise sends);
- ``rejections_total{reason}``, ``aborts_total{cause}``, ``verification_failures_total{check}``;
- ``pages{state}`` and ``quarantined_pages``: the ledger right now;
- ``fences_total``, ``writes_refused_total{reason}`` (stale generation, outside the window ...),
  ``stale_messages_total``, ``inflight_writes`` (posted, not yet completed), ``open_windows``;
- ``control_events_total{kind}``: malformed and refused control messages, authentication denials,
  refused data connections, dead peers, and the tcp data port's accept errors, connections over
  the cap, CONNECT timeouts and malformed CONNECTs; refused HELLOs, peers forgotten, RESULT timeouts
  and destinations refused for their size.

Counters are read from the engine's own bookkeeping at scrape time (one lock hold, no work on the
data path); only the histogram and the outcome counter are fed as transitions happen, through the
lifecycle observer. Each engine has its own registry, so several engines in one process do not
collide. ``prometheus_client`` is imported only when metrics are switched on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from ..core.lifecycle import Lifecycle, ReceiverState, SenderState

log = logging.getLogger("kvxfer.metrics")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTROL_EVENTS = ("malformed_messages", "refused_messages", "auth_denied", "impersonation_refused",
                  "refused_connections", "dead_peers", "connections_lost", "peer_errors", "control_loop_errors",
                  "flood_refused", "accept_errors", "data_connections_refused", "connect_timeouts",
                  "data_handshake_errors",
                  # the control plane's own limits (issue 15): refused HELLOs, peers forgotten, answers
                  # not sent, RESULTs that never came, destinations too large or over the byte cap
                  "refused_hellos", "peers_forgotten", "refusals_unanswered", "result_timeouts",
                  "stuck_links_closed", "oversized_meta", "meta_bytes_refused")


class EngineMetrics:
    """The registry, the fed series and the scrape-time collector of one engine."""

    def __init__(self, engine: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.engine = engine
        self.role = engine.role
        self.registry = CollectorRegistry(auto_describe=True)
        self.transfers = Counter("kvxfer_transfers", "requests by terminal state", ["role", "outcome"],
                                 registry=self.registry)
        self.latency = Histogram("kvxfer_transfer_seconds",
                                 "admission to verified (decode) / to the receiver's verdict (prefill)",
                                 ["role"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_Snapshot(engine))
        # the labelled children, looked up once: observe runs under the engine lock on every transition
        self._latency = self.latency.labels(self.role)
        self._outcomes: dict[Any, Any] = {}
        self._server: Any = None
        self._thread: Any = None
        self.address: str | None = None

    def observe(self, fsm: Lifecycle, old: Any, reason: str) -> None:
        """Lifecycle observer: outcome counts and latency."""
        state = fsm.state
        if state is ReceiverState.READABLE or state is SenderState.SUCCEEDED:
            self._latency.observe(fsm.age)
        if fsm.terminal:
            outcome = self._outcomes.get(state)
            if outcome is None:
                outcome = self._outcomes[state] = self.transfers.labels(self.role, state.value)
            outcome.inc()

    def serve(self, host: str, port: int) -> str:
        """Start the HTTP endpoint; returns its URL."""
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound = self._server.server_address[1]
        self.address = f"http://{host}:{bound}/metrics"
        log.info("%s: metrics at %s", self.engine.engine_id, self.address)
        return self.address

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


class _Snapshot:
    """Collector reading the engine's counters, ledger and requests at scrape time."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine = self.engine
        role = engine.role
        with engine.lock:
            logic = engine.receiver if role == "decode" else engine.sender
            stats = dict(logic.stats)
            counters = dict(engine.counters)
            pages = engine.pool.ledger.counts()
            active = list(logic.active.values())
            guard = engine.receiver.guard.counters() if role == "decode" else None

        def counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
            return CounterMetricFamily(f"kvxfer_{name}", doc, labels=["role", *(labels or [])])

        def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvxfer_{name}", doc, labels=["role", *(labels or [])])

        rejections = counter("rejections", "admission rejections by reason", ["reason"])
        for key, value in sorted(stats.items()):
            if key.startswith("rejected_"):
                rejections.add_metric([role, key[len("rejected_"):]], value)
        yield rejections

        aborts = counter("aborts", "aborted requests by cause", ["cause"])
        causes = ({"caller": "aborted", "timeout": "timed_out", "connection": "failed_connection"}
                  if role == "decode" else {"caller": "aborted", "peer": "aborted_by_peer"})
        for cause, key in causes.items():
            aborts.add_metric([role, cause], stats.get(key, 0))
        yield aborts

        failures = counter("verification_failures", "completions that failed verification, by check", ["check"])
        for key, value in sorted(stats.items()):
            if key.startswith("verification_failed_"):
                failures.add_metric([role, key[len("verification_failed_"):]], value)
        if role == "prefill":
            failures.add_metric([role, "reported_by_decode"], stats.get("failed", 0))
        yield failures

        state_pages = gauge("pages", "pool pages by ledger state", ["state"])
        for state, count in pages.items():
            state_pages.add_metric([role, str(state)], count)
        yield state_pages
        quarantined = gauge("quarantined_pages", "pages frozen until a drain proof or a fence")
        quarantined.add_metric([role], pages.get("quarantined", 0))
        yield quarantined

        fences = counter("fences", "data connections fenced (decode) or fenced by the peer (prefill)")
        fences.add_metric([role], counters.get("fences" if role == "decode" else "fenced_by_peer", 0))
        yield fences

        stale = counter("stale_messages", "messages for an old generation or unknown request, refused")
        stale.add_metric([role], stats.get("stale_messages", 0) + stats.get("stale_abort", 0)
                         + stats.get("stale_result", 0) + stats.get("stale_reject", 0) + stats.get("stale_meta", 0)
                         + stats.get("unexpected_drain_ack", 0))
        yield stale

        control = counter("control_events", "control-plane events off the happy path", ["kind"])
        for kind in CONTROL_EVENTS:
            control.add_metric([role, kind], counters.get(kind, 0) + stats.get(kind, 0))
        yield control

        moved = counter("bytes", "payload bytes landed (decode) or posted (prefill)", ["direction"])
        if guard is not None:
            moved.add_metric([role, "received"], guard["landed_bytes"])
        else:
            moved.add_metric([role, "sent"], stats.get("bytes_posted", 0))
        yield moved

        if role == "prefill":
            layers = counter("layer_sends", "sends of some buffers only (a layer, as the forward computed it)", [])
            layers.add_metric([role], stats.get("layer_sends", 0))
            yield layers
            inflight = gauge("inflight_writes", "writes posted and not yet completed")
            inflight.add_metric([role], sum(max(0, r.posted - r.completed) for r in active))
            yield inflight

        if guard is not None:
            refused = counter("writes_refused", "writes refused by the write guard, by reason", ["reason"])
            for reason, count in sorted(guard["refused_by_reason"].items()):
                refused.add_metric([role, reason], count)
            yield refused
            windows = gauge("open_windows", "requests whose pages accept writes now")
            windows.add_metric([role], sum(1 for r in active if r.state is ReceiverState.RESERVED))
            yield windows
