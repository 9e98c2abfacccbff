"""The engine's metric building blocks, shared by the loading and the serving `/metrics`.

Cumulative latency histograms the engine's threads write and a scrape reads: the stepping
thread records a request's latencies as its outputs go out, a scrape reads the counts from
another thread. One writer per histogram and plain int updates keep this lock-free: a
scrape may see a sample's bucket before its sum, never lose a sample. (prometheus_client's
own `Histogram` would do too, but the engine exports through a collector that labels every
series at scrape time with engine, model and role, so it keeps the counts itself.)

Plus the lifecycle state and weights families, which both apps export. Names and buckets
are documented in docs/metrics.md.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from tandem_engine.lifecycle import EngineState
from tandem_engine.weights import WeightIdentity

# Request latencies at the engine (time to first token, end to end): 1 ms to 10 minutes.
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# The gap between tokens, an engine step and a KV pull: 0.5 ms to 10 s.
TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)
STEP_BUCKETS = TOKEN_GAP_BUCKETS
HANDOFF_BUCKETS = TOKEN_GAP_BUCKETS


class LatencyHistogram:
    """Bucket counts and a sum, in seconds; `bounds` ascending, `+Inf` implied."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds {bounds} must be strictly ascending")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, seconds: float, times: int = 1) -> None:
        """Record `seconds` (`times` samples of it)."""
        self._counts[bisect.bisect_left(self.bounds, seconds)] += times
        self._sum += seconds * times

    def observe_all(self, samples: Iterable[float]) -> None:
        for s in samples:
            self.observe(s)

    def family(self, name: str, doc: str, labels: list[str],
               values: list[str]) -> HistogramMetricFamily:
        """The histogram as one labelled series of a metric family."""
        counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(name, doc, labels=labels)
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric(values, buckets, total)
        return family


def engine_state_family(labels: list[str], values: list[str],
                        state: EngineState) -> GaugeMetricFamily:
    """`tandem_engine_state{state}`: one series per lifecycle state, 1 for `state`."""
    family = GaugeMetricFamily("tandem_engine_state", "The engine's lifecycle state: 1 for "
                               "the current one, 0 for the others",
                               labels=[*labels, "state"])
    for s in EngineState:
        family.add_metric([*values, str(s)], 1.0 if s is state else 0.0)
    return family


def weights_info_family(labels: list[str], values: list[str],
                        weights: WeightIdentity) -> GaugeMetricFamily:
    """`tandem_weights_info{version,epoch,uri}` = 1: the weights served now."""
    family = GaugeMetricFamily("tandem_weights_info", "The weights served now (value 1)",
                               labels=[*labels, "version", "epoch", "uri"])
    family.add_metric([*values, weights.version, str(weights.epoch), weights.uri], 1.0)
    return family
