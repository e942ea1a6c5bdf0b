"""Kernels of the cache runtime: torch reference semantics everywhere, Triton on CUDA tensors.

Call these functions, not the implementations: each picks the Triton kernel when its inputs live on a CUDA
device and Triton is importable, and the torch reference (``kvgates.kernels.reference``) otherwise.
"""

from kvgates.kernels.reference import (
    GROUP_REDUCTIONS,
    attention_probs,
    column_sums,
    decode_attention,
    compact_slots,
    decode_attention_flat,
    dense_groups,
    group_reduce,
    masked_attention,
    pool_by_position,
    retention_scores,
    retention_sum,
    scatter_flat,
    visibility,
    window_scores,
    window_scores_flat,
)

__all__ = [
    "GROUP_REDUCTIONS",
    "attention_probs",
    "column_sums",
    "decode_attention",
    "compact_slots",
    "decode_attention_flat",
    "dense_groups",
    "group_reduce",
    "masked_attention",
    "pool_by_position",
    "retention_scores",
    "retention_sum",
    "scatter_flat",
    "visibility",
    "window_scores",
    "window_scores_flat",
]
