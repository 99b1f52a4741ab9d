"""/metrics: the runtime's counters and KV-cache gauges in Prometheus' text format.

A collector reads the runtime's figures at scrape time, so nothing is counted twice and the
engine keeps no Prometheus objects of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from flare.serve.memory_plan import MemoryPlan
from flare.serve.runtime import Runtime

COUNTERS = {
    "requests_finished",
    "requests_failed",
    "prompt_tokens",
    "generated_tokens",
    "preemptions",
    "steps",
    "busy_seconds",
    "step_seconds",
    "device_wait_seconds",
    "kv_prefix_hit_tokens",
    "kv_evictions",
    "compilations",
}
"""Figures that only grow; the others are levels (running, waiting, blocks used)."""
RANK_GAUGES = {"rank_weight_bytes", "rank_kv_bytes", "rank_load_seconds", "rank_peak_rss_bytes"}
"""Per-rank figures that are levels; the others (collective and send seconds) grow."""


class RuntimeCollector:
    """Counters (monotonic totals) and gauges (levels) from one runtime, and `flare_build_info`
    (always 1): the package and the flare serving it as labels, so that a dashboard can tell
    which package digest a figure came from."""

    def __init__(self, runtime: Runtime, build: Mapping[str, str]) -> None:
        self.runtime = runtime
        self.build = build

    def collect(self) -> Iterator[Metric]:
        yield InfoMetricFamily("flare_build", "the package served and this flare", self.build)
        figures = dict(self.runtime.stats())
        figures |= {f"kv_{key}": value for key, value in self.runtime.kv_stats().items()}
        for key, value in sorted(figures.items()):
            kind = CounterMetricFamily if key in COUNTERS else GaugeMetricFamily
            yield kind(f"flare_{key}", key.replace("_", " "), value=value)
        yield from _rank_metrics(self.runtime.rank_stats())
        yield from _memory_metrics(self.runtime.memory_plan)


def _memory_metrics(plan: MemoryPlan | None) -> Iterator[Metric]:
    """The start's memory plan: bytes per part, and the device's memory as the plan found it."""
    if plan is None:
        return
    parts = GaugeMetricFamily("flare_memory_bytes", "memory plan bytes", labels=["part"])
    for part, nbytes in plan.parts().items():
        parts.add_metric([part], nbytes)
    yield parts
    device = GaugeMetricFamily(
        "flare_device_memory_bytes", "device memory at start", labels=["state"]
    )
    device.add_metric(["total"], plan.total)
    device.add_metric(["free"], plan.free)
    yield device


def _rank_metrics(ranks: Mapping[int, Mapping[str, float]]) -> Iterator[Metric]:
    """Per tensor-parallel rank figures, one family each, labelled rank="R"."""
    keys = sorted({key for figures in ranks.values() for key in figures})
    for key in keys:
        kind = GaugeMetricFamily if key in RANK_GAUGES else CounterMetricFamily
        family = kind(f"flare_{key}", key.replace("_", " "), labels=["rank"])
        for rank, figures in sorted(ranks.items()):
            if key in figures:
                family.add_metric([str(rank)], figures[key])
        yield family


def render_metrics(runtime: Runtime, build: Mapping[str, str]) -> tuple[str, str]:
    """The exposition text and its content type; `build`: flare_build_info's labels."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RuntimeCollector(runtime, build))  # type: ignore[arg-type]
    return generate_latest(registry).decode(), CONTENT_TYPE_LATEST
