"""What ``GET /metrics`` reports: requests by status, latency percentiles, tokens and tokens/s, batching.

Written to from the event loop (requests) and the batcher's thread (generations), hence the lock.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque

LATENCY_WINDOW = 10_000
"""Latencies kept for the percentiles: the most recent successful chat completions."""


def percentile(sorted_values: list[float], fraction: float) -> float | None:
    """The nearest-rank percentile (``fraction`` in (0, 1]) of ascending ``sorted_values``; None if empty."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(fraction * len(sorted_values)) - 1)]


class ServerMetrics:
    """Counters of one server process since it started."""

    def __init__(self, batch_window_ms: float = 0.0):
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.batch_window_ms = batch_window_ms
        self.by_status: Counter[int] = Counter()
        self.in_flight = 0
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.prompt_tokens = self.completion_tokens = 0
        self.generate_calls = self.batched_requests = self.batched_rows = self.largest_batch = 0
        self.generate_seconds = 0.0
        self.cancelled_before_generation = self.cancelled_during_generation = 0

    def request_started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def request_finished(self, status: int, seconds: float) -> None:
        """A chat completion ended (its whole body sent, streams included) with HTTP ``status``."""
        with self._lock:
            self.in_flight -= 1
            self.by_status[status] += 1
            if 200 <= status < 300:
                self.latencies.append(seconds)

    def generated(self, *, requests: int, rows: int, prompt_tokens: int, completion_tokens: int,
                  seconds: float) -> None:
        """One generate_team call served ``requests`` requests (``rows`` prompts) in ``seconds``."""
        with self._lock:
            self.generate_calls += 1
            self.batched_requests += requests
            self.batched_rows += rows
            self.largest_batch = max(self.largest_batch, requests)
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.generate_seconds += seconds

    def tokens(self, prompt_tokens: int, completion_tokens: int) -> None:
        """A request's tokens, counted where continuous batching answers it (no generate calls to count)."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens

    def cancelled(self, *, before_generation: bool) -> None:
        """A job whose client went away: dropped from the queue, or its generation's result discarded."""
        with self._lock:
            if before_generation:
                self.cancelled_before_generation += 1
            else:
                self.cancelled_during_generation += 1

    def snapshot(self, queue_depth: int = 0) -> dict:
        """Everything, as the JSON ``/metrics`` returns."""
        with self._lock:
            latencies = sorted(self.latencies)
            uptime = time.monotonic() - self.started
            total = sum(self.by_status.values())
            return {
                "uptime_seconds": round(uptime, 3),
                "requests": {
                    "total": total,
                    "in_flight": self.in_flight,
                    "queued": queue_depth,
                    "errors": sum(n for status, n in self.by_status.items() if status >= 400),
                    "by_status": {str(status): n for status, n in sorted(self.by_status.items())},
                },
                "latency_seconds": {
                    "count": len(latencies),
                    "mean": sum(latencies) / len(latencies) if latencies else None,
                    **{f"p{q}": percentile(latencies, q / 100) for q in (50, 95, 99)},
                },
                "tokens": {
                    "prompt": self.prompt_tokens,
                    "completion": self.completion_tokens,
                    # While generating (the models' throughput) and over the server's life (what it delivered).
                    "completion_per_generate_second": self.completion_tokens / self.generate_seconds
                    if self.generate_seconds else None,
                    "completion_per_uptime_second": self.completion_tokens / uptime if uptime else None,
                },
                "batching": {
                    "window_ms": self.batch_window_ms,
                    "generate_calls": self.generate_calls,
                    "requests_per_call": self.batched_requests / self.generate_calls if self.generate_calls else None,
                    "largest_call": self.largest_batch,
                    "generate_seconds": round(self.generate_seconds, 3),
                },
                "cancelled": {
                    "before_generation": self.cancelled_before_generation,
                    "during_generation": self.cancelled_during_generation,
                },
            }


def prometheus_text(snapshot: dict) -> str:
    """``snapshot`` in Prometheus' text exposition format (``GET /metrics?format=prometheus``)."""
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float | None]]) -> None:
        lines.extend([f"# HELP teamrl_{name} {help_text}", f"# TYPE teamrl_{name} {kind}"])
        lines.extend(f"teamrl_{name}{labels} {value}" for labels, value in samples if value is not None)

    requests, latency, tokens = snapshot["requests"], snapshot["latency_seconds"], snapshot["tokens"]
    metric("requests_total", "counter", "Chat completions by HTTP status.",
           [(f'{{status="{status}"}}', n) for status, n in requests["by_status"].items()])
    metric("requests_in_flight", "gauge", "Chat completions being answered.", [("", requests["in_flight"])])
    metric("latency_seconds", "summary", "Latency of successful chat completions (recent ones).",
           [(f'{{quantile="0.{q}"}}', latency[f"p{q}"]) for q in (50, 95, 99)] + [("_count", latency["count"])])
    metric("prompt_tokens_total", "counter", "Prompt tokens of generated rows.", [("", tokens["prompt"])])
    metric("completion_tokens_total", "counter", "Generated tokens.", [("", tokens["completion"])])
    metric("generate_calls_total", "counter", "Batched generate calls.",
           [("", snapshot["batching"]["generate_calls"])])
    metric("generate_seconds_total", "counter", "Seconds spent generating.",
           [("", snapshot["batching"]["generate_seconds"])])
    metric("cancelled_total", "counter", "Requests whose client went away.",
           [(f'{{when="{when}"}}', n) for when, n in snapshot["cancelled"].items()])
    return "\n".join(lines) + "\n"
