"""Concurrent clients against one OpenAI server for a bounded time, every completion checked.

:func:`run_load` starts ``clients`` threads that each send the prompts of a shuffled cycle, one request
at a time, until ``duration_s`` has passed, and compares every completion with the cold reference of
its prompt (same tokens, logprobs within a tolerance). The :class:`LoadReport` counts errors and
mismatches, the prompt tokens the server did not compute (hits) and the latency percentiles.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvpolicy.harness.server import Completion, OpenAIServer

__all__ = ["LoadReport", "run_load", "shared_prefix_prompts"]


def shared_prefix_prompts(
    *, prefixes: int, variants: int, prefix_tokens: int, suffix_tokens: int, vocab_size: int = 384, seed: int = 7
) -> list[list[int]]:
    """``prefixes × variants`` prompts: each of ``prefixes`` random prefixes with ``variants`` suffixes."""
    generator = random.Random(seed)
    tokens = lambda count: [generator.randrange(3, vocab_size) for _ in range(count)]  # noqa: E731
    heads = [tokens(prefix_tokens) for _ in range(prefixes)]
    return [head + tokens(suffix_tokens) for head in heads for _ in range(variants)]


@dataclass(frozen=True)
class LoadReport:
    """What ``clients`` concurrent clients saw in ``duration_s``."""

    clients: int
    duration_s: float
    requests: int
    errors: int
    """Requests that raised (HTTP error, timeout, refused connection)."""
    mismatches: int
    """Completions whose tokens differ from the prompt's cold reference, or whose logprobs are off."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens the server reported it did not compute."""
    latencies_s: tuple[float, ...]
    error_samples: tuple[str, ...] = ()
    """The first few errors, as text."""

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def throughput(self) -> float:
        """Completed requests per second."""
        return (self.requests - self.errors) / self.duration_s if self.duration_s else 0.0

    def percentile(self, fraction: float) -> float:
        if not self.latencies_s:
            return float("nan")
        if len(self.latencies_s) == 1:
            return self.latencies_s[0]
        cuts = statistics.quantiles(self.latencies_s, n=100, method="inclusive")
        return cuts[min(98, max(0, round(fraction * 100) - 1))]


def _matches(completion: Completion, reference: Completion, tolerance: float) -> bool:
    return completion.tokens == reference.tokens and all(
        abs(a - b) <= tolerance for a, b in zip(completion.logprobs, reference.logprobs, strict=True)
    )


def run_load(
    server: OpenAIServer,
    prompts: Sequence[Sequence[int]],
    references: Sequence[Completion],
    *,
    clients: int = 8,
    duration_s: float = 30.0,
    max_tokens: int = 8,
    tolerance: float = 1e-3,
    request_timeout_s: float = 120.0,
    seed: int = 0,
) -> LoadReport:
    """Drive ``server`` with ``clients`` concurrent clients for ``duration_s`` and check every completion."""
    if len(prompts) != len(references) or not prompts:
        raise ValueError("one reference completion per prompt, and at least one prompt")
    lock = threading.Lock()
    latencies: list[float] = []
    samples: list[str] = []
    counts = {"requests": 0, "errors": 0, "mismatches": 0, "prompt": 0, "cached": 0}
    deadline = time.monotonic() + duration_s
    started = time.monotonic()

    def client(index: int) -> None:
        order = list(range(len(prompts)))
        random.Random(seed * 1000 + index).shuffle(order)
        position = 0
        while time.monotonic() < deadline:
            which = order[position % len(order)]
            position += 1
            sent = time.monotonic()
            try:
                completion = server.complete(prompts[which], max_tokens=max_tokens, timeout=request_timeout_s)
            except Exception as error:  # noqa: BLE001 - any failure of a request is what this counts
                with lock:
                    counts["requests"] += 1
                    counts["errors"] += 1
                    if len(samples) < 3:
                        samples.append(f"{type(error).__name__} after {time.monotonic() - sent:.1f} s: {str(error)[:1500]}")
                continue
            elapsed = time.monotonic() - sent
            with lock:
                counts["requests"] += 1
                latencies.append(elapsed)
                counts["prompt"] += len(prompts[which])
                counts["cached"] += completion.cached_tokens or 0
                if not _matches(completion, references[which], tolerance):
                    counts["mismatches"] += 1

    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(client, range(clients)))
    return LoadReport(
        clients=clients,
        duration_s=time.monotonic() - started,
        requests=counts["requests"],
        errors=counts["errors"],
        mismatches=counts["mismatches"],
        prompt_tokens=counts["prompt"],
        cached_tokens=counts["cached"],
        latencies_s=tuple(sorted(latencies)),
        error_samples=tuple(samples),
    )
