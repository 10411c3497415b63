"""Split-K over a long context, shared by the decode kernels (`paged_decode`, `paged_verify`,
`mla_decode`): each split writes its unnormalised partial output, its running max (base 2)
and its sum into a float32 workspace [rows, heads, splits, width + 2], and one kernel merges
the splits of every (row, head) into the output."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels import _pdl


@triton.jit
def _merge_kernel(
    ws_ptr,     # [>=batch, num_q_heads, num_splits, head_dim + 2] fp32: acc, max (base 2), sum
    out_ptr,    # [batch, num_q_heads, head_dim]
    stride_wb, stride_wh, stride_ws, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    _pdl.wait(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < NUM_SPLITS
    ws = ws_ptr + seq.to(tl.int64) * stride_wb + head * stride_wh + offs_s * stride_ws
    m = tl.load(ws + HEAD_DIM, mask=mask_s, other=float("-inf"))
    l = tl.load(ws + HEAD_DIM + 1, mask=mask_s, other=0.0)
    acc = tl.load(ws[:, None] + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    m_max = tl.max(m, 0)
    # Empty splits carry m = -inf; guard -inf - -inf when the whole row is empty.
    w = tl.where(m > float("-inf"), tl.math.exp2(m - tl.maximum(m_max, -1e30)), 0.0)
    l_sum = tl.sum(w * l, 0)
    o = tl.sum(w[:, None] * acc, 0) / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@functools.cache
def num_sms(device: torch.device) -> int:
    """The multiprocessors the split counts are planned for (1 off CUDA)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_workspace(batch: int, num_q_heads: int, head_dim: int, num_splits: int,
                     device: torch.device | str) -> torch.Tensor:
    """Preallocated split-K workspace for the decode kernels (allocate once, outside CUDA graphs).

    Returns float32 [batch, num_q_heads, num_splits, head_dim + 2]; its shape[2] sets the
    split count of every launch that receives it. Size: 4 * batch * num_q_heads *
    num_splits * (head_dim + 2) bytes.
    """
    return torch.empty(batch, num_q_heads, num_splits, head_dim + 2, dtype=torch.float32, device=device)


def workspace_args(workspace: torch.Tensor | None, out: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The split kernel's workspace argument and strides (out and zeros when unused: one split)."""
    if workspace is None:
        return out, (0, 0, 0)
    return workspace, (workspace.stride(0), workspace.stride(1), workspace.stride(2))


def merge_splits(workspace: torch.Tensor, out: torch.Tensor, rows: int, ws_strides: tuple[int, int, int]) -> None:
    """The splits' partial results of out's first `rows` rows, merged into out."""
    num_splits, head_dim = workspace.shape[2], out.shape[2]
    pdl = _pdl.pdl(out)
    _merge_kernel[(rows, out.shape[1])](
        workspace, out, *ws_strides, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )
