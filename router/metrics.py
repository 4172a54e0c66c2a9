"""Prometheus metrics of the HTTP front end, named after vLLM's where one exists (``vllm:`` ->
``pdserve:``), each labelled with the served model's name (``model_name``), as vLLM's are, so that
dashboards and alerts that select on it work.

Latencies are measured where the front end sees them (request arrival, each chunk, the end);
the phases of a request (queue, prefill, KV transfer, decode) come from the ``timings`` of its
``final`` message; running/waiting requests, KV usage, refused and failed transfers and the prefix cache's
counters per worker group, each group's readiness and the router's fault counts come from the
cluster's ``stats`` reply, read at each scrape. One
registry per server, never the process-wide default, so that several servers (tests) never
share counters.

Several front-end processes on one port (``launch.py --api-servers N``) share their counters and
histograms through prometheus_client's multiprocess mode: with ``PROMETHEUS_MULTIPROC_DIR`` set
in its environment (before prometheus_client is imported, which is when it picks where values
live), each process keeps its values in files of that directory, and the scrape, whichever
process it reaches, sums every process's files, those of processes that have exited included, so
that totals never go back when one is restarted. The front end's own metrics are counters and
histograms only: the gauges are the cluster's, from the router's one ``stats`` reply, the same
whichever process reads it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from pdserve.cluster.protocol import Stats

# As vLLM: no ``*_created`` series, a timestamp per counter and histogram that scrapers rarely
# read (the multiprocess mode writes none either, so one front end or several expose the same).
disable_created_metrics()

PREFIX = "pdserve:"
# Where prometheus_client's multiprocess mode keeps every process's values (its own variable).
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# vLLM's buckets, with finer ones below 10 ms, where a GPU's inter-token latencies fall.
# fmt: off
TTFT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# fmt: on

# final.timings key -> histogram name (without the prefix) and help.
PHASES = {
    "queue": (
        "request_queue_time_seconds",
        "Time from the request reaching the router to the start of its prefill.",
    ),
    "prefill": ("request_prefill_time_seconds", "Time from first scheduling to the first token sampled."),
    "transfer": ("kv_transfer_time_seconds", "Time to move the prompt's KV cache from prefill to decode."),
    "decode": ("request_decode_time_seconds", "Time generating the tokens after the first."),
}

# stats.faults key -> counter name (without the prefix and _total) and help: the router's own,
# since it started.
FAULTS = {
    "group_failures": ("group_failures", "Worker group failures (a rank died, hung, or stopped its heartbeats)."),
    "restarts": ("group_restarts", "Worker groups the launcher started again after a failure."),
    "migrated": ("requests_migrated", "Moves of a request off a failed group, to go on elsewhere."),
    "worker_failed": ("requests_worker_failed", "Requests ended with a worker_failed error past --migration-limit."),
}


class FrontendMetrics:
    """The front end's metrics in their own registry; ``exposition()`` is the /metrics body."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"{PREFIX}{name}", doc, ["model_name"], buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"{PREFIX}{name}", doc, ["model_name"], registry=r).labels(model_name)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time from the HTTP request's arrival to its first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between consecutive chunks of tokens of a request.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from the HTTP request's arrival to its last token.", REQUEST_BUCKETS
        )
        self.phases = {key: histogram(name, doc, REQUEST_BUCKETS) for key, (name, doc) in PHASES.items()}
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished requests.")
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens a request.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens a request.", TOKEN_BUCKETS
        )
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "Bytes of KV cache moved from prefill to decode groups.")
        self.success = Counter(
            f"{PREFIX}request_success",
            "Requests that ran to their end, by finish reason (abort: the client went away).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.errors = Counter(
            f"{PREFIX}request_error",
            "Requests answered with an error, by reason (the error code).",
            ["model_name", "reason"],
            registry=r,
        )
        self.cluster = ClusterCollector(model_name)
        shared = os.environ.get(MULTIPROC_DIR_ENV)
        # In multiprocess mode the metrics above write to the shared files; what is exposed is
        # every process's files summed, not this registry (which would add this process twice).
        self.exposed = r if not shared else CollectorRegistry()
        if shared:
            MultiProcessCollector(self.exposed, path=shared)
        self.exposed.register(self.cluster)

    def observe_final(self, finish_reason: str, usage: Mapping[str, int], timings: Mapping[str, float]) -> None:
        """A request's end: its finish reason, token counts and the cluster's phase timings."""
        self.success.labels(self.model_name, finish_reason).inc()
        prompt, generated = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.request_prompt_tokens.observe(prompt)
        self.request_generation_tokens.observe(generated)
        for key, histogram in self.phases.items():
            if key in timings:
                histogram.observe(timings[key])
        if "transfer_bytes" in timings:
            self.kv_transfer_bytes.inc(timings["transfer_bytes"])

    def observe_error(self, reason: str) -> None:
        self.errors.labels(self.model_name, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.exposed)


class ClusterCollector(Collector):
    """Gauges (and the counters of refused and failed transfers, of the prefix cache and of the
    router's faults) from the latest ``stats`` reply, read at scrape time; nothing but
    ``cluster_ready`` while the cluster has not answered."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: Stats | None = None

    def collect(self) -> Iterator[Metric]:
        stats, m = self.stats, self.model_name
        up = GaugeMetricFamily(
            f"{PREFIX}cluster_ready",
            "1 when the cluster answered the last scrape's stats request with every group ready.",
            labels=["model_name"],
        )
        up.add_metric([m], float(stats is not None and stats.ready))
        yield up
        if stats is None:
            return
        in_flight = GaugeMetricFamily(
            f"{PREFIX}cluster_requests_in_flight",
            "Requests accepted by the cluster and not yet ended, over all its clients.",
            labels=["model_name"],
        )
        in_flight.add_metric([m], stats.requests_in_flight)
        yield in_flight
        families = {
            "running": GaugeMetricFamily(
                f"{PREFIX}num_requests_running",
                "Sequences running in a group's scheduler.",
                labels=["model_name", "group"],
            ),
            "waiting": GaugeMetricFamily(
                f"{PREFIX}num_requests_waiting",
                "Sequences waiting in a group's scheduler.",
                labels=["model_name", "group"],
            ),
            "usage": GaugeMetricFamily(
                f"{PREFIX}kv_cache_usage_perc",
                "Fraction of a group's KV blocks in use (1 = all).",
                labels=["model_name", "group"],
            ),
            "kv_held": GaugeMetricFamily(
                f"{PREFIX}kv_transfers_pending",
                "Prefill: requests holding their KV until it moves; decode: KV receives in flight.",
                labels=["model_name", "group"],
            ),
            "prefix_cached_blocks": GaugeMetricFamily(
                f"{PREFIX}prefix_cache_blocks",
                "KV blocks a group's prefix cache holds, used by requests or evictable.",
                labels=["model_name", "group"],
            ),
        }
        refused = CounterMetricFamily(
            f"{PREFIX}kv_transfer_refused",
            "KV announcements the decode side refused for lack of blocks or buffer room (the prefill side retries).",
            labels=["model_name", "group"],
        )
        failures = CounterMetricFamily(
            f"{PREFIX}kv_transfer_failures",
            "KV transfers that failed or were given up, as the group counts them (refusals are not failures).",
            labels=["model_name", "group"],
        )
        counters = {
            "prefix_queried_tokens": CounterMetricFamily(
                f"{PREFIX}prefix_cache_queries",
                "Prompt tokens looked up in a group's prefix cache.",
                labels=["model_name", "group"],
            ),
            "prefix_hit_tokens": CounterMetricFamily(
                f"{PREFIX}prefix_cache_hits",
                "Prompt tokens a group's prefix cache held.",
                labels=["model_name", "group"],
            ),
            "prefix_evicted_blocks": CounterMetricFamily(
                f"{PREFIX}prefix_cache_evicted_blocks",
                "KV blocks a group's prefix cache evicted to make room.",
                labels=["model_name", "group"],
            ),
            "preemptions": CounterMetricFamily(
                f"{PREFIX}num_preemptions",
                "Sequences a group preempted for want of KV blocks (their KV is recomputed).",
                labels=["model_name", "group"],
            ),
        }
        for group, g in sorted(stats.groups.items()):
            families["running"].add_metric([m, group], g.get("running", 0))
            families["waiting"].add_metric([m, group], g.get("waiting", 0))
            total = g.get("num_blocks", 0)
            families["usage"].add_metric([m, group], 1.0 - g.get("free_blocks", 0) / total if total else 0.0)
            families["kv_held"].add_metric([m, group], g.get("kv_held", 0))
            families["prefix_cached_blocks"].add_metric([m, group], g.get("prefix_cached_blocks", 0))
            refused.add_metric([m, group], g.get("kv_refused", 0))
            failures.add_metric([m, group], g.get("kv_transfer_failures", 0))
            for key, counter in counters.items():
                counter.add_metric([m, group], g.get(key, 0))
        yield from families.values()
        yield refused
        yield failures
        yield from counters.values()
        ready = GaugeMetricFamily(
            f"{PREFIX}group_ready",
            "1 while a worker group serves; 0 while it starts, drains or is down (a restart, a node gone).",
            labels=["model_name", "group"],
        )
        for member in stats.members:
            ready.add_metric([m, f"{member.role}{member.group}"], float(member.state == "ready"))
        yield ready
        for key, (name, doc) in FAULTS.items():
            fault = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=["model_name"])
            fault.add_metric([m], stats.faults.get(key, 0))
            yield fault
