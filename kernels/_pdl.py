"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start
while the kernel before it on the stream is still finishing, and waits (`gdc_wait`) for
that kernel's completion and memory before it reads or writes anything an earlier kernel
touches. Between the small kernels of a decode step the GPU otherwise idles for each
launch; under CUDA graph capture the dependency becomes a programmatic edge.

Every kernel that takes `PDL` waits before it touches memory, and right after `wait`,
`launch_dependents` lets the next kernel launch (a chain is at most two kernels deep, each
but the oldest waiting). A launcher's `read_ahead=True` lets it load, before the wait, what
its caller promises was final before the kernel preceding it started: the weights, the
rotary tables, the step's inputs (positions, slots, lengths, block tables), the KV of
earlier positions. It stores nothing before the wait. The engine keeps that promise: a
step's inputs are uploaded before its first kernel (torch's embedding, launched without
PDL, so it starts only once everything before it has finished), and its weights and
earlier KV do not change during a step. Without it (the default) nothing is read early:
a kernel right after the one that wrote its inputs is safe.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def _supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl(tensor: torch.Tensor) -> bool:
    """Whether launches of kernels on `tensor`'s device use programmatic dependent launch
    (a CUDA device of compute capability 9 or later; never in Triton's interpreter)."""
    return _supported(tensor.device)


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the previous kernel on the stream to finish (and its writes to land), then
    let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
