"""Each sequence's prompt length seen so far, its padding left out: what per-sequence budget schedules are built from
(PyramidKV's pyramid, D2O's layer ratios), so that a short row of a left-padded batch gets the budgets it gets alone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from kvgates.runtime.stats import AttnStats

if TYPE_CHECKING:
    from kvgates.runtime.layer import BudgetLayer


class PromptStart(Protocol):
    """A layer state that keeps each sequence's first position ``[B]`` (None until a prompt forward brings padding)."""

    first_position: torch.Tensor | None


def prompt_lengths(layer: BudgetLayer, start: PromptStart, stats: AttnStats | None) -> list[int]:
    """Each sequence's prompt seen so far by ``layer`` (the first budgeted layer, at the end of a prompt forward, before
    that forward evicts): the tokens the layer has seen, for every sequence while no forward brought padding (known on
    the host: no read); else its newest position less its first, plus one (one read).

    A row's first position is 0 where generate() numbers real tokens from 0, its padding where the model numbers every
    token (no ``position_ids``): kept in ``start.first_position``, the least position held at the end of each prompt
    forward since the first that brought padding, before that forward evicts (so a row's first token is among them
    when it arrives, in a chunk after chunks of only padding too); 0 where forwards without padding came before."""
    if not layer.padded:
        return [layer.seen] * layer.batch_size
    held = torch.where(layer.valid, layer.pos, torch.iinfo(layer.pos.dtype).max).amin(dim=(1, 2))
    if start.first_position is None:
        new = 0 if stats is None else stats.new_slots.shape[-1]
        earlier = layer.seen > new  # forwards without padding came first: every row's tokens are real from 0
        start.first_position = torch.zeros_like(held) if earlier else held
    else:
        start.first_position = torch.minimum(start.first_position, held)
    return (layer.pos.amax(dim=(1, 2)) - start.first_position + 1).clamp(min=1).tolist()
