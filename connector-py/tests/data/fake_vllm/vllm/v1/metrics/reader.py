"""The metric types of vllm/v1/metrics/reader.py (vLLM 0.26)."""

from dataclasses import dataclass


@dataclass
class Metric:
    name: str
    labels: dict


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict
