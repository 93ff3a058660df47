"""The api's Prometheus series (`GET /metrics`).

Latencies are per request, in seconds, measured in the api process from the moment the
request was admitted: time to first token (first text or token from the tokenizer),
time per output token after the first, and end to end. `lmd_requests_total` counts every
answered generation request by endpoint and HTTP status; a client that went away before
its answer counts as status 499 (nginx's "client closed request"). The engines' KV,
queue and migration series come from the supervisor at each scrape (cluster_metrics.py).

Several api processes (`--api-workers`) share their series through prometheus_client's
multiprocess mode: each process keeps its values in mmap'd files in the daemon's metrics
directory (paths.metrics_dir), and whichever process answers /metrics adds up all of
them (counters and histograms of every api process that ran since the daemon started;
`lmd_requests_running` of the live ones: the supervisor forgets a dead one's).
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from lmd.api.cluster_metrics import ClusterCollector

CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"  # where prometheus_client's values find their files
CLIENT_GONE = 499

# Seconds. TTFT spans a CPU prefill of a long prompt; TPOT a single decode step.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


def share_values(directory: Path) -> None:
    """Keep this process's series in `directory`, for every api process to add up.

    prometheus_client picks where values live when a series is made, and its multiprocess
    values find their directory in the environment: call this before any series exists.
    """
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[MULTIPROC_DIR] = str(directory)
    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


def forget_process(directory: Path, pid: int) -> None:
    """An api process ended: its requests are no longer running (its counts stay)."""
    mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]


class ApiMetrics:
    """`shared`: the directory every api process of the daemon keeps its series in (see
    above); None: this process's figures only."""

    def __init__(self, shared: Path | None = None, control_socket: Path | None = None) -> None:
        own = None if shared is not None else CollectorRegistry(auto_describe=True)
        self.registry = own if own is not None else CollectorRegistry()
        if shared is not None:
            share_values(shared)
            MultiProcessCollector(self.registry, str(shared))  # type: ignore[no-untyped-call]
        self.cluster = None if control_socket is None else ClusterCollector(control_socket)
        if self.cluster is not None:
            self.registry.register(self.cluster)
        self.time_to_first_token = Histogram(
            "lmd_time_to_first_token_seconds",
            "Seconds from admitting a request to its first output token.",
            buckets=_TTFT_BUCKETS,
            registry=own,
        )
        self.time_per_output_token = Histogram(
            "lmd_time_per_output_token_seconds",
            "Mean seconds per output token after the first, per request.",
            buckets=_TPOT_BUCKETS,
            registry=own,
        )
        self.e2e_request_latency = Histogram(
            "lmd_e2e_request_latency_seconds",
            "Seconds from admitting a request to its last token.",
            buckets=_E2E_BUCKETS,
            registry=own,
        )
        self.prompt_tokens = Counter(
            "lmd_prompt_tokens", "Prompt tokens of closed requests.", registry=own
        )
        self.prompt_tokens_cached = Counter(
            "lmd_prompt_tokens_cached",
            "Prompt tokens of closed requests the engines' prefix cache served, summed over "
            "their choices (the later choices of an n > 1 request find the prompt cached).",
            registry=own,
        )
        self.generation_tokens = Counter(
            "lmd_generation_tokens", "Tokens generated for closed requests.", registry=own
        )
        self.requests = Counter(
            "lmd_requests",
            "Generation requests answered, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=own,
        )
        self.requests_running = Gauge(
            "lmd_requests_running",
            "Requests admitted and not finished yet.",
            multiprocess_mode="livesum",
            registry=own,
        )

    def opened(self) -> None:
        self.requests_running.inc()

    def closed(self) -> None:
        self.requests_running.dec()

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def finished(self, *, e2e_s: float, first_token_s: float | None, num_tokens: int) -> None:
        """A request that got its last token (not an error, not aborted early)."""
        self.e2e_request_latency.observe(e2e_s)
        if first_token_s is not None and num_tokens > 1:
            self.time_per_output_token.observe((e2e_s - first_token_s) / (num_tokens - 1))

    def tokens(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> None:
        """What a closed request computed, finished or not: its prompt (once), the tokens
        of all its choices, and the prompt tokens each choice found cached."""
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_tokens_cached.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def scrape(self) -> bytes:
        """The exposition, with the engines' latest figures fetched first."""
        if self.cluster is not None:
            await self.cluster.refresh()
        return self.render()
