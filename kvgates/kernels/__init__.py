"""Kernels of the cache runtime: torch reference semantics everywhere, Triton on CUDA tensors.

Call these functions, not the implementations. Each of ``causal_attention_stats``, ``masked_attention_colmax``,
``masked_attention_colsum``, ``decode_attention_flat``, ``window_scores_flat``, ``pool_by_position``,
``compact_slots``, ``max_similarity``, ``merge_sets``, ``retention_scores`` and ``retention_sum`` runs its Triton kernel
(``kvgates.kernels.triton_ops``)
when its inputs are CUDA tensors and the torch reference (``kvgates.kernels.reference``) otherwise.
``KVGATES_KERNELS=reference`` forces the reference everywhere;
``KVGATES_KERNELS=triton`` forces Triton, which on CPU needs ``TRITON_INTERPRET=1`` (how CI runs the runtime
on the kernels); inside ``torch.compile`` every mode takes the reference (``backend``). The other functions here are
reference-only.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kvgates.kernels import reference
from kvgates.kernels.reference import (
    GROUP_REDUCTIONS,
    attention_probs,
    column_max,
    column_sums,
    decode_attention,
    dense_groups,
    group_reduce,
    masked_attention,
    scatter_flat,
    visibility,
    window_scores,
)

BACKENDS = ("auto", "reference", "triton")


def backend(tensor: torch.Tensor) -> str:
    """``"triton"`` or ``"reference"`` for kernels whose inputs live where ``tensor`` does. Inside ``torch.compile``
    every mode takes the torch reference, which inductor fuses into its own kernels (the path the CPU tests compile),
    rather than launching kvgates' Triton kernels from a traced graph (``KVGATES_KERNELS=triton`` forces them in eager
    code: dynamo cannot trace their launches, and a compiled decode step failed with a graph break)."""
    mode = os.environ.get("KVGATES_KERNELS", "auto")
    if mode not in BACKENDS:
        raise ValueError(f"KVGATES_KERNELS must be one of {BACKENDS}, got {mode!r}")
    if torch.compiler.is_compiling():
        return "reference"
    if mode == "auto":
        return "triton" if tensor.is_cuda and _triton_importable() else "reference"
    if mode == "triton" and not tensor.is_cuda:
        _check_interpreter(tensor)
    return mode


def _check_interpreter(tensor: torch.Tensor) -> None:
    """``ValueError`` in one sentence where ``KVGATES_KERNELS=triton`` would launch Triton on ``tensor``, not a CUDA
    tensor, without Triton's interpreter (Triton's own error: "0 active drivers"), or without Triton."""
    if not _triton_importable():
        raise ValueError("KVGATES_KERNELS=triton: Triton is not installed here; install it, or unset KVGATES_KERNELS")
    import triton

    if not triton.knobs.runtime.interpret:
        raise ValueError(
            f"KVGATES_KERNELS=triton on {tensor.device.type} tensors needs Triton's interpreter (TRITON_INTERPRET=1); set it, "
            "or unset KVGATES_KERNELS to run the torch reference there"
        )


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _impl(tensor: torch.Tensor) -> ModuleType:
    if backend(tensor) == "triton":
        from kvgates.kernels import triton_ops

        return triton_ops
    return reference


def causal_attention_stats(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, colsum: bool = True, window: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Causal prefill attention with the column sums and/or window scores of its probabilities, per query head
    (see ``reference.causal_attention_stats``)."""
    return _impl(q).causal_attention_stats(q, k, v, scale, colsum, window)


def masked_attention_colmax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_pos: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    scale: float,
    row_weight: torch.Tensor | None = None,
    col_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention under position visibility and the largest weighted probability of each slot, per query head (see
    ``reference.masked_attention_colmax``): KVzip's reconstruction forwards."""
    return _impl(q).masked_attention_colmax(q, k, v, slot_pos, q_pos, q_valid, scale, row_weight, col_weight)


def masked_attention_colsum(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_pos: torch.Tensor, q_pos: torch.Tensor, q_valid: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention under position visibility and the column sums of its probabilities, per query head (see
    ``reference.masked_attention_colsum``): H2O, D2O and KVMerger over a prompt chunk after others, or padded."""
    return _impl(q).masked_attention_colsum(q, k, v, slot_pos, q_pos, q_valid, scale)


def decode_attention_flat(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    caps: list[int],
    scale: float,
    reduce: str = "sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention plus per-slot probabilities over flat storage (see ``reference.decode_attention_flat``)."""
    return _impl(q).decode_attention_flat(q, keys, values, pos, caps, scale, reduce)


def window_scores_flat(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    caps: list[int],
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    scale: float,
    reduce: str = "sum",
) -> torch.Tensor:
    """Observation-window scores over flat storage (see ``reference.window_scores_flat``)."""
    return _impl(q).window_scores_flat(q, keys, values, pos, caps, q_pos, q_valid, scale, reduce)


def pool_by_position(scores: torch.Tensor, slot_pos: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """1-D pooling along token order (see ``reference.pool_by_position``)."""
    return _impl(scores).pool_by_position(scores, slot_pos, kernel, mode)


def compact_slots(
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    state: torch.Tensor,
    index: torch.Tensor,
    old_caps: list[int],
    new_caps: list[int],
    state_init: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rebuild a layer's storage from keep indices (see ``reference.compact_slots``)."""
    return _impl(pos).compact_slots(keys, values, pos, state, index, old_caps, new_caps, state_init)


def max_similarity(rows: torch.Tensor, cols: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest product with the valid columns, and the first column reaching it (see
    ``reference.max_similarity``)."""
    return _impl(rows).max_similarity(rows, cols, valid)


def merge_sets(
    keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor, mergeable: torch.Tensor, score: torch.Tensor,
    sigma: float | None = None, scale_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KVMerger's merge of each merging set into its pivot (see ``reference.merge_sets``)."""
    return _impl(keys).merge_sets(keys, values, starts, mergeable, score, sigma, scale_values)


def retention_scores(log_beta: torch.Tensor, slot_pos: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """TRIM-KV decayed retention scores (see ``reference.retention_scores``)."""
    return _impl(log_beta).retention_scores(log_beta, slot_pos, t)


def retention_sum(log_beta: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Training-time retention mass ``S_t`` with its gradient, at positions ``rows`` (default all; see
    ``reference.retention_sum``). The Triton kernel computes every ``t`` and the requested ones are selected."""
    if _impl(log_beta) is reference:
        return reference.retention_sum(log_beta, rows)
    from kvgates.kernels import triton_ops

    out = triton_ops.retention_sum(log_beta)
    return out if rows is None else out.index_select(-1, rows.to(out.device))


__all__ = [
    "BACKENDS",
    "GROUP_REDUCTIONS",
    "attention_probs",
    "backend",
    "causal_attention_stats",
    "column_max",
    "column_sums",
    "compact_slots",
    "decode_attention",
    "decode_attention_flat",
    "dense_groups",
    "group_reduce",
    "masked_attention",
    "masked_attention_colmax",
    "masked_attention_colsum",
    "max_similarity",
    "merge_sets",
    "pool_by_position",
    "retention_scores",
    "retention_sum",
    "scatter_flat",
    "visibility",
    "window_scores",
    "window_scores_flat",
]
