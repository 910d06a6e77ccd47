"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's Triton kernels.

A batch-1 decode step is ~300 short kernels, each waiting for the one before it to finish
before it even launches; every start then pays the launch and its first loads' DRAM latency
again. Launched dependent, a kernel's programs start while its predecessor's last ones still
run: they fetch what no earlier kernel writes (a GEMV's first weight tile), then wait
(`griddepcontrol.wait`) until the predecessor has finished and its writes are visible. Every
such kernel also lets its own successor start (`griddepcontrol.launch_dependents`) as soon as
it runs. Inside a CUDA graph the dependencies are captured as programmatic edges (CUDA 12.3+).

NOTE: a kernel launched with `launch_pdl=True` must, before `wait_for_previous`, read only
data no kernel of the step writes (weights, scales, constant tables) and store nothing; it
must call `wait_for_previous` on every path. Kernels launched normally need nothing: a
normal launch waits for its predecessor to complete, as always.

`KVFLEET_DEPENDENT_LAUNCH=0` launches every kernel normally (for A/B timing); 1, the default,
where the device can. Kernels take `**dependent_launch_args(device)`: their PDL flag and the
launch option always agree (a dependent launch of a kernel that does not wait would race).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV_SWITCH = "KVFLEET_DEPENDENT_LAUNCH"


@functools.cache
def _capable(index: int) -> bool:
    """Hopper or later, under a CUDA runtime that captures programmatic edges in graphs, with
    a Triton that launches dependent (3.4 on: `launch_pdl`, `gdc_wait`)."""
    runtime = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    if torch.cuda.get_device_capability(index) < (9, 0) or runtime < (12, 3):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch dependent: a CUDA device of compute capability 9.0
    or later, unless the environment turns it off (ValueError for a value other than 0 or 1)."""
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _dependent(device.type, index, os.environ.get(ENV_SWITCH, "1"))


@functools.cache
def _dependent(kind: str, index: int | None, switch: str) -> bool:
    # (cached: launchers ask at every launch, eager steps a few times a layer)
    if switch not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH} must be 0 or 1, got {switch!r}")
    if kind != "cuda" or switch == "0":
        return False
    assert index is not None
    return _capable(index)


_ARGS = {pdl: {"PDL": pdl, "launch_pdl": pdl} for pdl in (False, True)}


def dependent_launch_args(device: torch.device) -> dict[str, bool]:
    """A PDL-aware kernel's launch arguments on `device`: its `PDL` constexpr and Triton's
    `launch_pdl` option, set together (one shared dict each: spread, never changed)."""
    return _ARGS[dependent_launch(device)]


@triton.jit
def let_next_start(PDL: tl.constexpr):
    """Let the next kernel of the stream launch now (its programs wait before they read)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait until the previous kernel of the stream has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
