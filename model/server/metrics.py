"""The server's Prometheus metrics (prometheus-client, one registry per server).

Names follow vLLM's where one exists (prefix `kda_`, as vLLM's is `vllm:`):

| metric | kind | meaning |
|---|---|---|
| `kda_num_requests_running` | gauge | requests holding a slot (engine stats at scrape time) |
| `kda_num_requests_waiting` | gauge | requests beyond the free slots (queued to the engine loop included) |
| `kda_num_free_slots` | gauge | slots a new request could take now |
| `kda_num_compilations` | gauge | compiled step functions so far (one per shape bucket and variant) |
| `kda_prompt_tokens_total` | counter | prompt tokens of requests that finished prefill |
| `kda_cached_prompt_tokens_total` | counter | of which restored from the prefix cache |
| `kda_generation_tokens_total` | counter | generated tokens (rate() of it is tokens/s) |
| `kda_prefix_cache_hit_rate` | gauge | cached / prompt tokens since start (0 before any prompt) |
| `kda_prefix_cache_bytes` | gauge | bytes the prefix cache holds |
| `kda_request_success_total{finished_reason}` | counter | requests ended, by reason |
| `kda_time_to_first_token_seconds` | histogram | arrival to first token, as the handler sees it |
| `kda_time_per_output_token_seconds` | histogram | per request: (last - first token time) / (tokens - 1) |
| `kda_e2e_request_latency_seconds` | histogram | arrival to last token |
"""

from __future__ import annotations

import dataclasses

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from model.engine.api import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0)


class _EngineCounter(Collector):
  """Counters read from the engine's cumulative stats at scrape time."""

  def __init__(self, metrics: "ServerMetrics"):
    self._m = metrics

  def collect(self):
    s = self._m.served()
    for name, doc, value in (
        ("kda_prompt_tokens", "Prompt tokens of requests that finished prefill.", s.prompt_tokens),
        ("kda_cached_prompt_tokens", "Prompt tokens restored from the prefix cache.", s.cached_prompt_tokens),
        ("kda_generation_tokens", "Generated tokens.", s.generated_tokens)):
      c = CounterMetricFamily(name, doc)
      c.add_metric([], float(value))
      yield c


class ServerMetrics:
  """Metrics of one server. `stats` returns the engine's current `EngineStats` (the loop's snapshot);
  `waiting` the waiting count the server reports (the loop's, queued requests included). The token
  counters count from this object's creation: the engine's counters then (the start-up warm-up
  request's tokens) are subtracted, as the request counters and histograms never saw it."""

  def __init__(self, stats, waiting):
    self.stats, self._waiting = stats, waiting
    self._base = stats()
    self.registry = prom.CollectorRegistry()
    r = self.registry
    self.running = prom.Gauge("kda_num_requests_running", "Requests holding a slot.", registry=r)
    self.waiting = prom.Gauge("kda_num_requests_waiting", "Requests waiting for a slot.", registry=r)
    self.free_slots = prom.Gauge("kda_num_free_slots", "Slots a new request could take now.", registry=r)
    self.compilations = prom.Gauge("kda_num_compilations", "Compiled step functions so far.", registry=r)
    self.hit_rate = prom.Gauge("kda_prefix_cache_hit_rate", "Cached / prompt tokens since start.", registry=r)
    self.cache_bytes = prom.Gauge("kda_prefix_cache_bytes", "Bytes the prefix cache holds.", registry=r)
    self.finished = prom.Counter("kda_request_success", "Requests ended, by reason.", ["finished_reason"],
                                 registry=r)
    self.ttft = prom.Histogram("kda_time_to_first_token_seconds", "Arrival to first token.",
                               buckets=_LATENCY_BUCKETS, registry=r)
    self.tpot = prom.Histogram("kda_time_per_output_token_seconds", "Mean time between a request's tokens.",
                               buckets=_TPOT_BUCKETS, registry=r)
    self.e2e = prom.Histogram("kda_e2e_request_latency_seconds", "Arrival to last token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
    r.register(_EngineCounter(self))

  def observe_request(self, *, arrival: float, first: float | None, last: float | None, tokens: int,
                      reason: str) -> None:
    """Records one ended request (times from time.perf_counter(), seconds)."""
    self.finished.labels(finished_reason=reason).inc()
    if first is not None:
      self.ttft.observe(first - arrival)
    if last is not None:
      self.e2e.observe(last - arrival)
      if tokens > 1 and first is not None:
        self.tpot.observe((last - first) / (tokens - 1))

  def served(self) -> EngineStats:
    """The engine's current stats with the token counters counted since this object was created."""
    s, b = self.stats(), self._base
    return dataclasses.replace(s, prompt_tokens=s.prompt_tokens - b.prompt_tokens,
                               cached_prompt_tokens=s.cached_prompt_tokens - b.cached_prompt_tokens,
                               generated_tokens=s.generated_tokens - b.generated_tokens)

  def render(self) -> bytes:
    """The Prometheus text exposition, gauges refreshed from the engine now."""
    s: EngineStats = self.served()
    self.running.set(s.num_running)
    self.waiting.set(self._waiting())
    self.free_slots.set(s.num_free_slots)
    self.compilations.set(s.num_compilations)
    self.hit_rate.set(s.cached_prompt_tokens / s.prompt_tokens if s.prompt_tokens else 0.0)
    self.cache_bytes.set(s.prefix_cache_bytes)
    return prom.generate_latest(self.registry)
