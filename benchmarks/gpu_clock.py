"""The GPU's own clock (%globaltimer, ns) put on the host's CLOCK_MONOTONIC, for timing a
moment on the GPU against a moment in another process without host-side event waits.

Timing a GPU moment from the host through a CUDA event carries the event's delivery: on
an H200 a host spinning on an event recorded on an idle GPU saw it 30-50 us late, and the
lateness differs between events, so a difference of two such readings is off by tens of
microseconds either way. Here the GPU stamps its own clock instead (`stamp`, a one-thread
kernel queued where the moment is), and `GpuClock.calibrate` measures the offset between
the two clocks: a kernel writes %globaltimer into pinned host memory over and over while
the host reads it; a value read by host time h was written no later than h, so h - value
bounds the offset from above, and the smallest of many samples is within the PCIe write
latency plus one read of the ring (a few microseconds) of it. Converted stamps err late by
at most that, plus the clocks' drift since the calibration (~10 us per second measured on
an H200: calibrate again for long runs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_RING = 1024  # slots the calibration kernel cycles through (distinct addresses: no store is elided)


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _stamp_kernel(out_ptr):
    tl.store(out_ptr, _globaltimer())


@triton.jit
def _spin_kernel(ring_ptr, iters, RING: tl.constexpr):
    for i in range(iters):
        tl.store(ring_ptr + i % RING, _globaltimer())


def stamp(out: torch.Tensor) -> None:
    """Queue on the current stream: write the GPU clock (ns) into out[0] (int64, on the GPU)
    when the stream gets there."""
    assert out.dtype == torch.int64 and out.is_cuda
    _stamp_kernel[(1,)](out)


@dataclass(frozen=True)
class GpuClock:
    """host ns (CLOCK_MONOTONIC) = GPU ns + offset_ns."""

    offset_ns: int

    @classmethod
    def calibrate(cls, device: torch.device | str, samples: int = 2000) -> GpuClock:
        ring = torch.zeros(_RING, dtype=torch.int64, pin_memory=True)
        view = ring.numpy()
        with torch.cuda.device(device):
            _spin_kernel[(1,)](ring, 1 << 17, RING=_RING)  # a few ms of stamps while the host reads
            best, seen = None, 0
            for _ in range(samples):
                latest = int(view.max())
                read_by = time.monotonic_ns()
                if latest > seen:  # a fresh value: written (GPU time `latest`) before read_by
                    seen = latest
                    best = read_by - latest if best is None else min(best, read_by - latest)
            torch.cuda.synchronize(device)
        if best is None:
            raise RuntimeError("the GPU clock calibration read no values from the GPU")
        return cls(best)

    def to_host_s(self, gpu_ns: int) -> float:
        """A GPU clock reading as time.monotonic() seconds."""
        return (gpu_ns + self.offset_ns) / 1e9
