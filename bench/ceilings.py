"""Ceilings measured in the same run as a benchmark: copy bandwidth and matmul rate."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ceilings:
    copy_gbps: float  # bytes read + written per second, 1e9
    matmul_tflops: float  # in the benchmark's dtype

    def floor_s(self, num_bytes: float, flops: float) -> float:
        """The larger of the two times: moving `num_bytes` and doing `flops`."""
        return max(num_bytes / (self.copy_gbps * 1e9), flops / (self.matmul_tflops * 1e12))


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    """The median time of `fn` (device time on CUDA), after one warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def captured(fn: Callable[[], object]) -> Callable[[], None]:
    """`fn` captured in a CUDA graph (run once first on a side stream, so that Triton compiles
    outside the capture); replaying it, the returned callable, runs what `fn` launched."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> Ceilings:
    big = (1 << 30) if device.type == "cuda" else (1 << 26)  # elements
    src = torch.randn(big // 2, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src), device)
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul_s = median_seconds(lambda: a @ b, device)
    return Ceilings(
        copy_gbps=2 * (big // 2) * 4 / copy_s / 1e9, matmul_tflops=2 * n**3 / matmul_s / 1e12
    )


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (before reading a clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fp8_matmul_tflops(device: torch.device) -> float:
    """cuBLASLt's FP8 (e4m3) scaled GEMM rate at 8,192^3, 1e12 FLOP/s."""
    n = 8192
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    seconds = median_seconds(
        lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        device,
    )
    return 2 * n**3 / seconds / 1e12
