"""Prometheus metrics of the server, named as vLLM (v1) names them so existing dashboards work.

`ServerMetrics` owns its own CollectorRegistry (no global state): one per server app. Engine-wide
numbers (requests running / waiting, KV cache usage, preemptions, prefix-cache counters) are read
from `engine.stats()` at scrape time; per-request numbers (token counters, latency histograms) are
observed by a `RequestTracker` as the request's outputs arrive and when it ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.outputs import RequestOutput

logger = logging.getLogger(__name__)

__all__ = ["ServerMetrics", "RequestTracker", "CONTENT_TYPE_LATEST"]

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class _EngineStatsCollector:
    """Gauges and totals read from engine.stats() when /metrics is scraped; with data parallelism also
    each replica's, from replica_stats() (and whether it is up, from replica_alive())."""

    def __init__(self, stats: Callable[[], object], model_name: str, replica_stats: Callable[[], list] | None = None,
                 replica_alive: Callable[[], list[bool]] | None = None) -> None:
        self._stats = stats
        self._model_name = model_name
        self._replica_stats = replica_stats
        self._replica_alive = replica_alive

    def describe(self):
        return []  # collected lazily; nothing to check at registration

    def collect(self):
        try:
            s = self._stats()
        except Exception:  # a dead engine must not break the scrape of everything else
            logger.debug("engine stats unavailable", exc_info=True)
            return
        labels = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (deprecated name of vllm:kv_cache_usage_perc).", s.kv_cache_usage)
        yield gauge("tokenmill:num_free_kv_blocks", "Free KV-cache blocks (cached prefix blocks count as free).", s.num_free_blocks)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_cache_hits)
        spec = getattr(s, "spec_decode", None)
        if spec is not None:
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens)
            per_pos = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", labels=["model_name", "position"]
            )
            for position, count in enumerate(spec.accepted_per_pos):
                per_pos.add_metric([self._model_name, str(position)], count)
            yield per_pos
        if self._replica_stats is not None:
            yield from self._collect_replicas()

    def _collect_replicas(self):
        """Each data-parallel replica's series, under names of their own (tokenmill:replica_*, label
        `replica`): the engine-wide series above already sum them, and sharing their names would make a
        PromQL sum() over the name count everything twice."""
        try:
            per_replica = self._replica_stats()
            alive = self._replica_alive() if self._replica_alive is not None else [True] * len(per_replica)
        except Exception:
            logger.debug("replica stats unavailable", exc_info=True)
            return
        labels = ["model_name", "replica"]
        families = [
            (GaugeMetricFamily, "tokenmill:replica_up", "1 while the replica's process runs, 0 once it is gone.",
             lambda i, s: float(alive[i])),
            (GaugeMetricFamily, "tokenmill:replica_num_requests_running", "Requests in the replica's batches.",
             lambda i, s: s.num_running),
            (GaugeMetricFamily, "tokenmill:replica_num_requests_waiting", "Requests waiting in the replica.",
             lambda i, s: s.num_waiting),
            (GaugeMetricFamily, "tokenmill:replica_kv_cache_usage_perc", "The replica's KV-cache usage. 1 means 100 percent usage.",
             lambda i, s: s.kv_cache_usage),
            (GaugeMetricFamily, "tokenmill:replica_num_free_kv_blocks", "The replica's free KV-cache blocks.",
             lambda i, s: s.num_free_blocks),
            (CounterMetricFamily, "tokenmill:replica_num_preemptions", "Cumulative preemptions in the replica.",
             lambda i, s: s.num_preemptions),
            (CounterMetricFamily, "tokenmill:replica_prefix_cache_queries", "The replica's prefix cache queries, in tokens.",
             lambda i, s: s.prefix_cache_queries),
            (CounterMetricFamily, "tokenmill:replica_prefix_cache_hits", "The replica's prefix cache hits, in tokens.",
             lambda i, s: s.prefix_cache_hits),
        ]
        for family_class, name, doc, value in families:
            family = family_class(name, doc, labels=labels)
            for index, s in enumerate(per_replica):
                family.add_metric([self._model_name, str(index)], value(index, s))
            yield family


class ServerMetrics:
    """The server's metrics. `stats`: a callable returning the engine's EngineStats (read at scrape time);
    with data parallelism `replica_stats` and `replica_alive` give each replica's stats and liveness."""

    def __init__(self, model_name: str, max_model_len: int, stats: Callable[[], object] | None = None,
                 replica_stats: Callable[[], list] | None = None, replica_alive: Callable[[], list[bool]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r = self.registry
        label = ["model_name"]

        def counter(name: str, doc: str):
            return Counter(name, doc, label, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]):
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=r)
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.itl_old = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (deprecated name of vllm:inter_token_latency_seconds).",
            ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        if stats is not None:
            self.registry.register(_EngineStatsCollector(stats, model_name, replica_stats, replica_alive))

    def track(self) -> "RequestTracker":
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Observes one engine request: call on_output() for each (cumulative) RequestOutput, then finish()."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self._prompt_counted = False
        self._generated = 0  # tokens counted so far (all choices)
        self._per_choice: dict[int, int] = {}
        self._last_time: float | None = None
        self._first_seen = False
        self._done = False
        self._last: RequestOutput | None = None

    def on_output(self, out: RequestOutput) -> None:
        if self._done:
            return
        m = self.m
        now = time.monotonic()
        rm = out.metrics
        if not self._prompt_counted:
            self._prompt_counted = True
            m.prompt_tokens.inc(len(out.prompt_token_ids))
        total = sum(len(c.token_ids) for c in out.outputs)
        if total > self._generated:
            m.generation_tokens.inc(total - self._generated)
            self._generated = total
        # Tokens each sequence got since the last output (usually 1; more if outputs were coalesced).
        steps = 0
        for c in out.outputs:
            before = self._per_choice.get(c.index, 0)
            steps = max(steps, len(c.token_ids) - before)
            self._per_choice[c.index] = max(before, len(c.token_ids))
        token_time = (rm.last_token_time if rm is not None and rm.last_token_time is not None else now)
        if not self._first_seen and steps > 0:
            self._first_seen = True
            if rm is not None:
                first = rm.first_token_time if rm.first_token_time is not None else token_time
                m.ttft.observe(max(0.0, first - rm.arrival_time))
            # The first output may already hold several tokens (coalesced): spread the rest evenly.
            if rm is not None and rm.first_token_time is not None and steps > 1:
                self._observe_itl((token_time - rm.first_token_time) / (steps - 1), steps - 1)
            self._last_time = token_time
        elif steps > 0 and self._last_time is not None:
            self._observe_itl((token_time - self._last_time) / steps, steps)
            self._last_time = token_time
        self._last = out
        if out.finished:
            self.finish(out)

    def _observe_itl(self, gap: float, count: int) -> None:
        gap = max(0.0, gap)
        for _ in range(count):
            self.m.itl.observe(gap)
            self.m.itl_old.observe(gap)

    def finish(self, out: RequestOutput | None = None, aborted: bool = False) -> None:
        """The request ended: with its final output, or aborted (client gone, timeout, error)."""
        if self._done:
            return
        self._done = True
        m = self.m
        out = out or self._last
        if aborted or out is None:
            m.request_success["abort"].inc()
            return
        for c in out.outputs:
            reason = c.finish_reason if c.finish_reason in m.request_success else "abort"
            m.request_success[reason].inc()
        m.request_prompt_tokens.observe(len(out.prompt_token_ids))
        m.request_generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))
        rm = out.metrics
        if rm is None:
            return
        end = rm.finished_time if rm.finished_time is not None else time.monotonic()
        m.e2e.observe(max(0.0, end - rm.arrival_time))
        if rm.first_scheduled_time is not None:
            m.queue.observe(max(0.0, rm.first_scheduled_time - rm.arrival_time))
            last = rm.last_token_time if rm.last_token_time is not None else end
            m.inference.observe(max(0.0, last - rm.first_scheduled_time))
            if rm.first_token_time is not None:
                m.prefill.observe(max(0.0, rm.first_token_time - rm.first_scheduled_time))
        if rm.first_token_time is not None and rm.last_token_time is not None:
            m.decode.observe(max(0.0, rm.last_token_time - rm.first_token_time))
            longest = max((len(c.token_ids) for c in out.outputs), default=0)
            if longest > 1:
                m.tpot.observe(max(0.0, (rm.last_token_time - rm.first_token_time) / (longest - 1)))
