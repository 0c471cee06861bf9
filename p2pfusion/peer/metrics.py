"""A peer's Prometheus metrics, in a registry of its own (tests run several peers in one process).

Gauges, and the counters the server already keeps, are read from the peer's state when scraped;
steps, errors, busy refusals and the compute thread's forwards are observed as they happen, by
`StageServer` and `Scheduler`. `serve_metrics` exposes the registry over HTTP. docs/metrics.md
lists every metric.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from p2pfusion.errors import ConfigError, PeerBusy, PeerFailed, RequestError, SessionExpired
from p2pfusion.models.stage import Stage
from p2pfusion.peer.batching import Pending
from p2pfusion.peer.session import Session

if TYPE_CHECKING:  # the server builds its metrics: importing it here would be circular
    from p2pfusion.peer.server import StageServer

log = logging.getLogger(__name__)

STAGE = ["model", "layers"]
SECONDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
ROWS = tuple(float(1 << i) for i in range(13))  # 1 to 4096 positions per forward
# an error's kind is that of the first class it is an instance of: subclasses come first
ERROR_KINDS = ((PeerBusy, "busy"), (SessionExpired, "expired"), (PeerFailed, "peer_failed"), (RequestError, "request"))


def error_kind(error: BaseException | str) -> str:
    """The `kind` label of an error a peer answers with ("internal": a bug on the peer)."""
    if isinstance(error, str):
        return error
    return next((kind for cls, kind in ERROR_KINDS if isinstance(error, cls)), "internal")


def layers_label(stage: Stage) -> str:
    return f"{stage.start}:{stage.end}"


class StageMetrics(Collector):
    """One peer's metrics, labelled with its model's key and the layers that served them. Until
    `watch` is given the peer's server, the registry holds only what was observed."""

    def __init__(self, model: str):
        self.model = model
        self.registry = CollectorRegistry()
        self._server: StageServer | None = None
        by_kind, registry = [*STAGE, "kind"], self.registry
        self.steps = Counter("p2pfusion_steps", "Steps served", by_kind, registry=registry)
        self.tokens = Counter(
            "p2pfusion_tokens", "Positions computed by the steps served (sequences x tokens)", by_kind, registry=registry
        )
        self.step_seconds = Histogram(
            "p2pfusion_step_seconds", "Seconds from a step's arrival to its output sent on (to the next hop or the client)",
            by_kind, buckets=SECONDS, registry=registry,
        )
        self.compute_seconds = Histogram(
            "p2pfusion_step_compute_seconds",
            "Seconds of a step in the stage's compute, waiting for the compute thread included",
            by_kind, buckets=SECONDS, registry=registry,
        )
        self.forward_rows = Histogram(
            "p2pfusion_forward_rows", "Positions per forward run on the compute thread, the steps batched in it together",
            STAGE, buckets=ROWS, registry=registry,
        )
        self.forward_seconds = Histogram(
            "p2pfusion_forward_seconds", "Seconds of each forward run on the compute thread",
            STAGE, buckets=SECONDS, registry=registry,
        )
        self.errors = Counter("p2pfusion_errors", "Errors this peer answered with, by kind", by_kind, registry=registry)
        self.refused = Counter(
            "p2pfusion_sessions_refused_busy", "Sessions refused for want of room here (answered busy)",
            STAGE, registry=registry,
        )

    def watch(self, server: StageServer) -> None:
        """Read `server`'s state at each scrape, and time its compute thread's forwards."""
        self._server = server
        server.compute.scheduler.observe = self.forward_ran
        self.registry.register(self)

    def _stage(self, stage: Stage | None = None) -> tuple[str, str]:
        return self.model, layers_label(self._server.stage if stage is None else stage)

    def step(self, session: Session, arrived: float, compute_seconds: float, positions: int, backward: bool = False) -> None:
        """A step's output was sent on; `arrived`: when its frame was read (perf_counter)."""
        kind = "training_backward" if backward else "training_forward" if session.training else "inference"
        labels = (*self._stage(session.stage), kind)  # a session opened before a move runs on its old layers
        self.steps.labels(*labels).inc()
        self.tokens.labels(*labels).inc(positions)
        self.step_seconds.labels(*labels).observe(time.perf_counter() - arrived)
        self.compute_seconds.labels(*labels).observe(compute_seconds)

    def error(self, error: BaseException | str) -> None:
        self.errors.labels(*self._stage(), error_kind(error)).inc()

    def refused_busy(self) -> None:
        self.refused.labels(*self._stage()).inc()

    def forward_ran(self, jobs: list[Pending], seconds: float) -> None:
        """The compute thread ran `jobs` as one forward (or one alone) in `seconds`."""
        labels = self._stage()
        self.forward_rows.labels(*labels).observe(sum(job.rows for job in jobs))
        self.forward_seconds.labels(*labels).observe(seconds)

    def collect(self) -> Iterator[Metric]:
        """Runs on the exporter's thread. `list` copies the sessions in one step under the GIL, so
        the figures agree with each other even while the peer's loop opens and closes sessions."""
        server = self._server
        model, layers = self._stage()
        sessions = list(server.sessions.values())
        yield InfoMetricFamily(
            "p2pfusion_peer", "This peer: its id, its model's key and the layers it serves",
            value={"peer_id": server.peer_id, "model": model, "layers": layers},
        )
        opened = CounterMetricFamily("p2pfusion_sessions_opened", "Sessions admitted since the peer started", labels=STAGE)
        opened.add_metric([model, layers], server.sessions_opened)
        yield opened
        for name, doc, value in (
            ("p2pfusion_sessions_open", "Sessions open now", len(sessions)),
            ("p2pfusion_queue_depth", "Jobs waiting for the compute thread", server.compute.scheduler.queued),
            (
                "p2pfusion_kv_cache_reserved_bytes",
                "Bytes the open sessions reserve: KV caches grown to their max length, training sessions' saved inputs",
                sum(session.reserved for session in sessions),
            ),
            ("p2pfusion_kv_cache_budget_bytes", "Bytes all sessions together may reserve", server.limits.budget.total),
            ("p2pfusion_training_memory_bytes", "Activations kept for training sessions' backward passes", server.graph_bytes),
            (
                "p2pfusion_training_memory_budget_bytes", "Activations that may be kept; beyond, backward passes recompute",
                server.compute.training_memory,
            ),
            ("p2pfusion_draining", "1 while the peer refuses new sessions (leaving, or moving to other layers)", int(server.draining)),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=STAGE)
            gauge.add_metric([model, layers], value)
            yield gauge


@dataclass
class Exporter:
    """A registry served over HTTP by prometheus_client, on a thread of its own."""

    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.httpd.server_port

    def close(self) -> None:
        """Blocks up to half a second: the server's loop looks for shutdown that often."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> Exporter:
    """Serve `registry` at http://host:port/metrics (port 0: a free one). A port taken, or an
    address not this machine's, is a ConfigError of one line."""
    try:
        httpd, thread = start_http_server(port, host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {(exc.strerror or str(exc)).lower()}") from None
    exporter = Exporter(httpd, thread)
    where = f"[{host}]" if ":" in host else host
    log.info("Prometheus metrics at http://%s:%d/metrics", where, exporter.port)
    return exporter
