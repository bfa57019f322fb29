"""Benchmark metrics: per-request latency (TTFT, TPOT, ITL), throughput, memory, FLOPs and peak rates.

Pure bookkeeping plus a few timed micro-benchmarks (peak matmul FLOP/s, copy bandwidth) that the
benchmark runs in the same process as the systems it measures, so the ratios are taken under the
same machine load.
"""

from __future__ import annotations

import math
import os
import resource
import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass
class RequestTrace:
    """Timing of one request: `arrival` and every output time are perf_counter seconds."""

    prompt_len: int
    arrival: float
    output_times: list[float] = field(default_factory=list)  # one entry per released token
    token_ids: list[int] = field(default_factory=list)

    def record(self, token_ids: list[int], now: float) -> None:
        self.token_ids.extend(token_ids)
        self.output_times.extend([now] * len(token_ids))

    @property
    def ttft(self) -> float | None:
        return self.output_times[0] - self.arrival if self.output_times else None

    @property
    def e2e(self) -> float | None:
        return self.output_times[-1] - self.arrival if self.output_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.output_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    def itls(self) -> list[float]:
        t = self.output_times
        return [b - a for a, b in zip(t, t[1:])]


def summary(values) -> dict:
    """mean, p50, p99 (and n) of a list of numbers; None entries are dropped; NaN when empty."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return dict(n=0, mean=math.nan, p50=math.nan, p99=math.nan)
    return dict(n=len(xs), mean=sum(xs) / len(xs), p50=percentile(xs, 50), p99=percentile(xs, 99))


def percentile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted list (numpy's default method)."""
    k = (len(sorted_xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)


def latency_metrics(traces: list[RequestTrace]) -> dict:
    """TTFT, TPOT, ITL and end-to-end latency summaries in milliseconds."""
    ms = lambda xs: [None if x is None else 1000 * x for x in xs]  # noqa: E731
    return dict(
        ttft_ms=summary(ms(t.ttft for t in traces)),
        tpot_ms=summary(ms(t.tpot for t in traces)),
        itl_ms=summary(ms(x for t in traces for x in t.itls())),
        e2e_ms=summary(ms(t.e2e for t in traces)),
    )


def throughput_metrics(traces: list[RequestTrace], wall_s: float) -> dict:
    out = sum(len(t.token_ids) for t in traces)
    total = out + sum(t.prompt_len for t in traces)
    wall = max(wall_s, 1e-9)
    return dict(
        wall_s=wall_s,
        output_tokens=out,
        total_tokens=total,
        requests=len(traces),
        output_tokens_per_s=out / wall,
        total_tokens_per_s=total / wall,
        requests_per_s=len(traces) / wall,
    )


# -- memory ---------------------------------------------------------------------------------------
def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class PeakMemory:
    """Context manager sampling RSS in a thread (peak while inside), plus CUDA peak allocated memory."""

    def __init__(self, device: torch.device | str = "cpu", interval_s: float = 0.02) -> None:
        self.device, self.interval_s = torch.device(device), interval_s
        self.peak_rss_bytes = 0
        self.peak_gpu_bytes: int | None = None
        self._stop = threading.Event()

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak_rss_bytes = current_rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_rss_bytes = max(self.peak_rss_bytes, current_rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_rss_bytes = max(self.peak_rss_bytes, current_rss_bytes())
        if self.device.type == "cuda":
            self.peak_gpu_bytes = torch.cuda.max_memory_allocated(self.device)

    def as_dict(self) -> dict:
        return dict(
            peak_rss_mb=self.peak_rss_bytes / 2**20,
            peak_gpu_mb=None if self.peak_gpu_bytes is None else self.peak_gpu_bytes / 2**20,
        )


# -- FLOPs and bytes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelCost:
    """What one token costs in a litgpt GPT: matmul weights in the blocks, attention width, lm_head."""

    block_linear_params: int  # weights of every nn.Linear inside the transformer blocks
    lm_head_params: int
    n_layer: int
    attn_width: int  # n_head * head_size (query side)
    kv_width: int  # n_query_groups * head_size
    weight_bytes: int  # every parameter, as stored

    @classmethod
    def of(cls, gpt: torch.nn.Module) -> ModelCost:
        c = gpt.config
        linear = sum(m.weight.numel() for m in gpt.transformer.h.modules() if isinstance(m, torch.nn.Linear))
        params = {id(p): p for p in gpt.parameters()}.values()  # tied weights counted once
        return cls(
            linear,
            gpt.transformer.wte.weight.numel(),
            c.n_layer,
            c.n_head * c.head_size,
            c.n_query_groups * c.head_size,
            sum(p.numel() * p.element_size() for p in params),
        )

    def token_flops(self, pos: int) -> float:
        """Forward FLOPs of feeding one token at position `pos` (attends to pos + 1 keys), no lm_head."""
        return 2 * self.block_linear_params + 4 * self.n_layer * self.attn_width * (pos + 1)

    def span_flops(self, start: int, n: int) -> float:
        """Feeding tokens at positions start .. start+n-1 (closed form of the sum of token_flops)."""
        keys = n * start + n * (n + 1) // 2
        return 2 * self.block_linear_params * n + 4 * self.n_layer * self.attn_width * keys

    def request_flops(self, prompt_len: int, n_generated: int) -> float:
        """Useful FLOPs of one request: prompt + all generated tokens but the last are fed, and the
        lm_head runs once per generated token."""
        fed = prompt_len + max(n_generated - 1, 0)
        return self.span_flops(0, fed) + 2 * self.lm_head_params * n_generated


def useful_flops(cost: ModelCost, traces: list[RequestTrace]) -> float:
    return sum(cost.request_flops(t.prompt_len, len(t.token_ids)) for t in traces)


# -- peak rates measured in this run ----------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_matmul_flops(
    device: torch.device | str = "cpu", n: int = 2048, reps: int = 5, dtype: torch.dtype = torch.float32
) -> float:
    """Best-of-`reps` FLOP/s of an n x n x n matmul (2 n^3 FLOPs): the peak the model's matmuls aim at."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up: thread pool, kernel choice
    best = math.inf
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def measure_copy_bandwidth(device: torch.device | str = "cpu", nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Best-of-`reps` bytes/s of a device-to-device tensor copy, counting bytes read + written."""
    device = torch.device(device)
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def measure_peaks(device, precisions: list[str], matmul_n: int = 2048, copy_mb: int = 256) -> dict:
    """Peak matmul FLOP/s per precision (`matmul_flops_per_s[precision]`) and copy bandwidth, measured now."""
    matmul = {p: measure_peak_matmul_flops(device, n=matmul_n, dtype=getattr(torch, p)) for p in precisions}
    return dict(
        matmul_flops_per_s=matmul,
        copy_bytes_per_s=measure_copy_bandwidth(device, nbytes=copy_mb * 2**20),
        matmul_shape=f"{matmul_n}x{matmul_n}x{matmul_n}",
        copy_bytes=copy_mb * 2**20,
    )
