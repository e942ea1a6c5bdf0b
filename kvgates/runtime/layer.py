"""One decoder layer's budgeted KV cache: slots with positions, per-slot policy state, ragged head storage.

Storage. Keys and values live in one flat buffer ``[B, S, D]`` per tensor; KV head ``h`` owns the slot range
``offsets[h] : offsets[h] + head_slots[h]``. When every head has as many slots (the usual case) the buffer is
exactly a dense ``[B, H_kv, C, D]`` tensor viewed flat; Ada-KV style per-head quotas give heads different
numbers of slots, and memory then follows the per-head quotas instead of the largest one. Slot positions and
per-slot policy state are small and kept padded to ``[B, H_kv, max_slots]``; a padded index
``j >= head_slots[h]`` does not exist and always reads as empty.

A slot is *valid* when its position is ``>= 0``. Positions never shift, and slot order says nothing about token
order: policies read positions, never slot indices.

Packed layout. The layer keeps, on the host, ``fill`` (per head: slots ``>= fill[h]`` are free) and ``packed``
(every slot below ``fill[h]`` is valid, for every sequence). Evictions compact the kept tokens to the front of
each head, so a layer whose sequences hold as many tokens stays packed, and a decode step then appends at
``fill`` and attends over a plain slice of storage (no mask, no search for free slots, no host sync). Padding
tokens or sequences holding different numbers of tokens leave the layer unpacked, and it falls back to the
general path (free-slot search, visibility from positions) until an eviction packs it again. Heads holding
different numbers of tokens (Ada-KV's head budgets, KVMerger's merges) stay packed: a decode step appends at each
head's fill (slot numbers on the device from a base copied once, ``_fill_base``) and attends over the slots below
the largest fill with a mask sliced from a ruler built once (``_fill_mask``; uniform storage) or head by head
(ragged storage), again without a host sync.

Vocabulary: a policy's ``budget`` is its parameter (tokens per KV head); a layer's ``quota`` ``[B, H_kv]`` is
what each head of each sequence may hold after the latest eviction (a budget after per-layer, per-sequence or
per-head adjustments); ``head_slots`` is storage (what is allocated, quota plus slack).

Policy step. After each attention call ``step`` runs the policy: ``observe`` (state updates), then, when its
``schedule`` says so, ``enforce`` — the one eviction path: ``quota``, and for the sequences holding more than
it, ``select`` (the keep mask), then ``evict`` — and finally ``after_layer`` (cross-layer decisions, which
``enforce`` other layers the same way).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvgates import kernels
from kvgates.runtime.rope import shift_rotary
from kvgates.runtime.stats import NO_STATS, AttnStats, Phase

if TYPE_CHECKING:
    from kvgates.policies.base import Policy
    from kvgates.runtime.cache import BudgetCache

# The layer whose update() ran last and whose attention call is due. transformers calls the cache's update()
# and then the attention function, which does not receive the cache; this hand-over joins the two.
ACTIVE_LAYER: ContextVar[BudgetLayer | None] = ContextVar("kvgates_active_layer", default=None)

_POS_BIG = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class SlotState:
    """A per-slot float32 tensor a policy keeps on each layer (cumulative attention, attention-row history, ...).

    Attributes:
        shape: trailing shape per slot (``()`` for a scalar).
        init: value a freshly written slot starts with.
    """

    shape: tuple[int, ...] = ()
    init: float = 0.0

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))


@dataclass
class LayerState:
    """Base of a policy's own values on one layer (thresholds, per-sequence budgets, ring pointers ...).

    Subclass it as a dataclass with defaults and name it in the policy's ``state_type``; the layer creates one per
    policy on first use (``Policy.layer_state``). Tensor fields are per sequence (dim 0) and follow beam
    reordering and batch selection; other fields are per layer.
    """

    def select_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, fn(value))


class StateViews(dict):
    """Named views into a layer's packed per-slot state. Assigning to a name writes into the storage
    (so ``layer.state["score"] += x`` updates the layer, as with a plain tensor attribute)."""

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if name not in self:
            raise KeyError(f"no per-slot state {name!r}; the policy declares {sorted(self)}")
        target = dict.__getitem__(self, name)
        if value is not target:
            target.copy_(value)


class BudgetLayer(CacheLayerMixin):
    """Budgeted KV storage of one layer; filled by ``update`` and attended by the ``"kvgates"`` attention."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: BudgetCache, layer_idx: int, rank: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.rank = rank  # index among the cache's budgeted layers (depth for per-layer budget schedules)
        self.head_slots: list[int] = []
        self.pos: torch.Tensor | None = None
        self.slot_data: torch.Tensor | None = None
        self.quota: torch.Tensor | None = None  # [B, H_kv] tokens each head may hold after the latest eviction
        self.seen = 0
        self.decoding = False  # whether a decode step has run (see ``phase``)
        self.decode_steps = 0
        self.fill: list[int] = []  # per head: slots >= fill[h] are free (see "Packed layout")
        self.packed = False  # every slot below fill[h] is valid, in every sequence
        self._quota_source: int | torch.Tensor | None = None  # the policy's quota ``quota`` was built from
        self._least_quota = 0  # its least entry, on the host
        self._policy_states: dict[int, LayerState] = {}
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._derived: dict[str, Any] = {}  # layout-derived tensors and state views, dropped when storage changes

    def __repr__(self) -> str:
        return f"BudgetLayer(layer={self.layer_idx}, head_slots={self.head_slots}, seen={self.seen})"

    @property
    def is_last(self) -> bool:
        """Whether this is the cache's last budgeted layer (cross-layer decisions happen after it)."""
        return self.rank == self.cache.num_budget_layers - 1

    def policy_state(self, policy: Policy) -> LayerState:
        """``policy``'s own values on this layer, created from its ``state_type`` on first use."""
        key = id(policy)
        if key not in self._policy_states:
            if policy.state_type is None:
                raise TypeError(f"{policy.name} declares no state_type, so it keeps no values on layers")
            self._policy_states[key] = policy.state_type()
        return self._policy_states[key]

    # ------------------------------------------------------------------ transformers Cache API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, hkv, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_kv_heads, self.head_dim = b, hkv, d
        self.keys = key_states.new_zeros((b, 0, d))
        self.values = value_states.new_zeros((b, 0, value_states.shape[-1]))
        self.head_slots = [0] * hkv
        self.fill, self.packed = [0] * hkv, False  # packed once written to (``_free_slots``) or compacted
        self.pos = torch.full((b, hkv, 0), -1, dtype=torch.int64, device=self.device)
        specs = self.cache.policy.slot_state()
        self._state_layout, offset = {}, 0
        for name, spec in specs.items():
            self._state_layout[name] = (offset, spec.shape)
            offset += spec.size
        init = [spec.init for spec in specs.values() for _ in range(spec.size)]
        self.state_init = torch.tensor(init, dtype=torch.float32, device=self.device)
        self.slot_data = torch.zeros((b, hkv, 0, offset), dtype=torch.float32, device=self.device)
        self._derived = {}
        self.is_initialized = True

    @property
    def state(self) -> StateViews:
        """Per-slot policy state by name, each ``[B, H_kv, max_slots, *shape]`` (views into ``slot_data``)."""
        if "state" not in self._derived:
            self._derived["state"] = self._state_views()
        return self._derived["state"]

    def _state_views(self) -> StateViews:
        views = StateViews()
        b, hkv, c, _ = self.slot_data.shape
        for name, (offset, shape) in self._state_layout.items():
            size = int(math.prod(shape))
            block = self.slot_data[..., offset : offset + size]
            dict.__setitem__(views, name, block.reshape(b, hkv, c, *shape) if shape else block[..., 0])
        return views

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the new keys/values; the ``"kvgates"`` attention call that follows stores and attends them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cache.claim_pending(self.layer_idx)
        self._pending = (key_states, value_states)
        ACTIVE_LAYER.set(self)
        return key_states, value_states

    def staged(self, layer_idx: int | None, key_states: torch.Tensor) -> bool:
        """Whether ``key_states`` of layer ``layer_idx`` are the tokens this layer staged for attention."""
        return layer_idx == self.layer_idx and self._pending is not None and self._pending[0] is key_states

    def get_seq_length(self) -> int:
        """Tokens *seen* (padding included), which generate() uses to place the next token."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.pos = self.slot_data = self.quota = None
        self.head_slots, self._policy_states = [], {}
        self.fill, self.packed, self._quota_source = [], False, None
        self.seen, self.decoding, self.decode_steps, self._pending = 0, False, 0, None
        self._derived = {}
        self.is_initialized = False

    def _select_batch(self, fn) -> None:
        """Apply a batch selection (beam reordering, repetition) to every per-sequence value: storage, positions,
        per-slot state, the quota and the tensors of every policy's layer state."""
        if not self.is_initialized:
            return
        self.keys, self.values, self.pos, self.slot_data = (
            fn(self.keys), fn(self.values), fn(self.pos), fn(self.slot_data)
        )
        if self.quota is not None:
            self.quota = fn(self.quota)
        for state in self._policy_states.values():
            state.select_batch(fn)
        self.batch_size = self.keys.shape[0]
        self._derived = {}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_batch(lambda t: t[indices.to(t.device)])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a BudgetCache cannot be cropped: evicted tokens cannot be restored")

    # ------------------------------------------------------------------ layout
    @property
    def max_slots(self) -> int:
        """The most slots any head has (the padded slot axis of ``pos`` and ``state``)."""
        return max(self.head_slots, default=0)

    @property
    def uniform(self) -> bool:
        """Whether every head has as many slots (storage is then a dense ``[B, H_kv, C, D]``)."""
        return len(set(self.head_slots)) <= 1

    @property
    def offsets(self) -> list[int]:
        out, acc = [], 0
        for c in self.head_slots:
            out.append(acc)
            acc += c
        return out

    @property
    def valid(self) -> torch.Tensor:
        """``[B, H_kv, C_max]`` slots holding a token."""
        return self.pos >= 0

    def exists(self) -> torch.Tensor:
        """``[H_kv, max_slots]`` padded slot indices that exist in each head's storage."""
        if "exists" not in self._derived:
            idx = torch.arange(self.max_slots, device=self.device)
            self._derived["exists"] = idx[None, :] < torch.tensor(self.head_slots, device=self.device)[:, None]
        return self._derived["exists"]

    def held(self) -> torch.Tensor:
        """``[B, H_kv]`` number of tokens held."""
        return self.valid.sum(-1)

    def kv_bytes(self) -> int:
        """Bytes of key/value storage allocated by this layer."""
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def head_views(self) -> list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Groups of KV heads with as many slots: ``(head_slice, keys, values, pos)`` dense views.

        One group covering every head when storage is uniform, else one group per head.
        """
        return kernels.dense_groups(self.keys, self.values, self.pos, self.head_slots)

    def _flat_index(self, index: torch.Tensor) -> torch.Tensor:
        """Padded per-head slot indices ``[B, H_kv, n]`` -> flat storage indices ``[B, H_kv, n]``."""
        if "offsets" not in self._derived:
            self._derived["offsets"] = torch.tensor(self.offsets, device=self.device)[None, :, None]
        return index + self._derived["offsets"]

    def relayout(self, index: torch.Tensor, head_slots: list[int]) -> None:
        """Rebuild storage with ``head_slots`` slots per head: new slot ``j`` of head ``h`` takes old slot
        ``index[b, h, j]`` (see ``kernels.compact_slots``; an index past a head's old slots makes an empty slot)."""
        self.keys, self.values, self.pos, self.slot_data = kernels.compact_slots(
            self.keys, self.values, self.pos, self.slot_data, index, self.head_slots, list(head_slots), self.state_init
        )
        self.head_slots = list(head_slots)
        self._derived = {}

    def _grow(self, extra: int) -> None:
        """Add ``extra`` empty slots after every head's slots: slice copies of the held storage (each head's
        segment followed by its new slots), no relayout, ragged or uniform."""
        b = self.batch_size

        def spaced(flat: torch.Tensor) -> torch.Tensor:
            """Flat ``[B, S, D]`` storage with ``extra`` zero slots after each head's segment."""
            gap = flat.new_zeros((b, extra, flat.shape[-1]))
            return torch.cat([part for head in flat.split(self.head_slots, dim=1) for part in (head, gap)], dim=1)

        def padded(dense: torch.Tensor, fill: torch.Tensor | float) -> torch.Tensor:
            """``[B, H_kv, C, ...]`` -> ``[B, H_kv, C + extra, ...]``, the new slots set to ``fill``."""
            tail = dense.new_empty((b, self.num_kv_heads, extra, *dense.shape[3:]))
            tail[:] = fill
            return torch.cat([dense, tail], dim=2)  # one copy of the old slots (padding would also zero them)

        self.keys, self.values = spaced(self.keys), spaced(self.values)
        self.pos, self.slot_data = padded(self.pos, -1), padded(self.slot_data, self.state_init)
        self.head_slots = [c + extra for c in self.head_slots]
        self._derived = {}

    def _growth(self, missing: int, n: int) -> int:
        """Slots to add when ``n`` new tokens lack ``missing`` free slots in some head. A prompt chunk grows by
        exactly what it needs. Decode steps of a policy that appends them (the full cache among them) grow storage
        geometrically, by an eighth: a copy of the held tokens every ``max_slots / 8`` steps instead of every step
        (DynamicCache copies its whole cache on every step), for up to an eighth more allocated than held
        (``kv_bytes`` counts it, ``held_bytes`` does not)."""
        return missing if n > 1 else max(missing, 16, self.max_slots // 8)

    def _slot_ids(self) -> torch.Tensor:
        """``[max_slots]`` slot numbers on the device (kept until storage changes)."""
        if "slot_ids" not in self._derived:
            self._derived["slot_ids"] = torch.arange(self.max_slots, device=self.device)
        return self._derived["slot_ids"]

    def _fill_base(self) -> tuple[torch.Tensor, int]:
        """``(base [1, H_kv, 1], steps)`` with ``base + steps`` each head's ``fill`` on the device, for a packed
        layer whose heads hold different numbers of tokens. Every packed write adds as many slots to every head,
        so ``base`` is copied to the device once (and again when storage or the fills change otherwise) and a step
        only adds the number of slots written since: no host-to-device copy per step."""
        f0, base = self._derived.get("fill_base", (None, None))
        steps = self.fill[0] - f0[0] if f0 is not None else -1
        if steps < 0 or any(f - g != steps for f, g in zip(self.fill, f0)):
            f0, steps = list(self.fill), 0
            base = torch.tensor(f0, device=self.device)[None, :, None]
            self._derived["fill_base"] = (f0, base)
        return base, steps

    def _fill_mask(self, groups: int) -> torch.Tensor:
        """``[1, H_kv * groups, 1, max(fill)]`` additive attention mask in the storage dtype, for a packed layer
        whose heads hold different numbers of tokens: 0 where slot ``j`` of head ``h`` holds a token
        (``j < fill[h]``), ``-inf`` past it; each KV head's row repeated for its ``groups`` query heads.

        Built once as a ruler (``ruler[h, k]`` visible iff ``k < fill0[h] + span``, ``span = max_slots``) and kept
        until storage changes: a step that adds ``t`` slots to every head makes the mask the ruler's slice
        starting ``t`` columns earlier, so a decode step slices instead of rebuilding (a new ruler after ``span``
        steps, or when the fills change otherwise)."""
        f0, ruler = self._derived.get("fill_mask", (None, None))
        steps = self.fill[0] - f0[0] if f0 is not None else -1
        span = ruler.shape[-1] - max(f0) if f0 is not None else 0
        stale = f0 is None or ruler.shape[1] != self.num_kv_heads * groups
        if stale or not 0 <= steps <= span or any(f - g != steps for f, g in zip(self.fill, f0)):
            f0, steps, span = list(self.fill), 0, self.max_slots
            limit = torch.tensor(f0, device=self.device)[:, None] + span
            visible = torch.arange(span + max(f0), device=self.device)[None, :] < limit
            ruler = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
            ruler = ruler.repeat_interleave(groups, dim=0)[None, :, None, :]
            self._derived["fill_mask"] = (f0, ruler)
        return ruler[..., span - steps : span + max(f0)]

    def _free_slots(self, n: int) -> torch.Tensor:
        """Slot indices ``[B, H_kv, n]`` of ``n`` free slots per head, growing storage if needed."""
        if self.max_slots == 0:  # no storage yet: trivially packed
            self.fill, self.packed = [0] * self.num_kv_heads, True
        if self.packed:  # the slots after each head's fill: known on the host
            missing = max(f + n - c for f, c in zip(self.fill, self.head_slots))
            if missing > 0:
                self._grow(self._growth(missing, n))
            fill = self.dense_fill
            if fill is not None:  # a view of the slot numbers, nothing allocated
                return self._slot_ids()[fill : fill + n].expand(self.batch_size, self.num_kv_heads, n)
            base, steps = self._fill_base()
            return (base + (self._slot_ids()[:n] + steps)).expand(self.batch_size, -1, -1)
        free = ~self.valid & self.exists()[None]
        missing = n - int(free.sum(-1).min()) if free.numel() else n
        if missing > 0:
            self._grow(self._growth(missing, n))
            free = ~self.valid & self.exists()[None]
        if n == 1:
            return free.to(torch.uint8).argmax(-1, keepdim=True)
        return torch.argsort((~free).to(torch.uint8), dim=-1, stable=True)[..., :n]

    # ------------------------------------------------------------------ writing and evicting
    def insert(
        self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor, all_real: bool = False
    ) -> torch.Tensor:
        """Write new tokens into free slots; ``positions`` is ``[B, n]`` with ``-1`` for padding (no slot kept);
        ``all_real`` tells the host that there is no padding (the layer then stays packed).

        Returns the ``[B, H_kv, n]`` slot indices used.
        """
        b, hkv, n, d = key_states.shape
        slots = self._free_slots(n)
        packed = self.packed  # read after ``_free_slots``, which packs a layer holding nothing yet
        f, c = self.dense_fill, self.max_slots
        if f is not None:  # the same contiguous slots in every head: slice writes
            self.keys.view(b, hkv, c, d)[:, :, f : f + n] = key_states
            self.values.view(b, hkv, c, -1)[:, :, f : f + n] = value_states
            self.pos[:, :, f : f + n] = positions[:, None, :]
            if self.slot_data.shape[-1]:
                self.slot_data[:, :, f : f + n] = self.state_init
        else:
            if packed:  # every sequence writes the same slots (each head's fill): copies along the flat slot axis
                flat = self._flat_index(slots[:1]).reshape(hkv * n)
                for store, new in ((self.keys, key_states), (self.values, value_states)):
                    store.index_copy_(1, flat, new.reshape(b, hkv * n, -1).to(store.dtype))
            else:
                kernels.scatter_flat([self.keys, self.values], self._flat_index(slots).reshape(b, hkv * n), [key_states, value_states])
            self.pos.scatter_(2, slots, positions[:, None, :].expand(b, hkv, n))
            if self.slot_data.shape[-1]:
                f = self.slot_data.shape[-1]
                self.slot_data.scatter_(2, slots[..., None].expand(b, hkv, n, f), self.state_init.expand(b, hkv, n, f).clone())
        self.fill = [f + n for f in self.fill] if packed else list(self.head_slots)
        self.packed = packed and all_real
        return slots

    def evict(self, keep: torch.Tensor, slack: int = 1) -> None:
        """Drop every valid slot not in ``keep`` (``[B, H_kv, max_slots]`` bool) and compact each head's kept
        tokens to its first slots.

        After eviction each head has what it holds (max over the batch) plus ``slack`` free slots for the tokens
        that arrive before the next eviction (storage shrinks when oversized); heads have different numbers of
        slots only when the policy asks for ragged heads. Called by ``enforce`` only.
        """
        fill = self.dense_fill
        keep = keep & self.valid
        self.pos = torch.where(keep, self.pos, torch.full_like(self.pos, -1))
        held = keep.sum(-1)  # [B, H_kv]
        least, most = torch.stack([held.amin(0), held.amax(0)]).tolist()  # the eviction's one host sync
        ragged = self.cache.policy.ragged_heads
        need = [n + slack for n in most] if ragged else [max(most) + slack] * len(most)
        if fill is not None and least == most and len(set(most)) == 1 and need[0] >= self.max_slots:
            self._fill_holes(keep, fill, most[0])
            self._derived.pop("probs", None)  # its entries past the new fill are no longer 0
        else:
            need = [min(n, c) for n, c in zip(need, self.head_slots)]
            # Kept slots first, in position order, then free slots.
            order = torch.argsort(torch.where(keep, self.pos, _POS_BIG), dim=-1, stable=True)[..., : max(need)]
            self.relayout(order.contiguous(), need)
        self.fill, self.packed = most, least == most

    def _fill_holes(self, keep: torch.Tensor, fill: int, kept: int) -> None:
        """Compact a dense layer in place when every head of every sequence keeps ``kept`` of its ``fill`` tokens:
        the tokens kept beyond slot ``kept`` move into the evicted slots below it (a decode eviction moves a few
        slots instead of rebuilding storage)."""
        moved = min(fill - kept, kept)
        if moved == 0:
            return
        holes = torch.argsort(keep[..., :kept].to(torch.uint8), dim=-1, stable=True)[..., :moved]  # evicted first
        tail = kept + torch.argsort((~keep[..., kept:fill]).to(torch.uint8), dim=-1, stable=True)[..., :moved]  # kept first
        # A row with fewer holes than ``moved`` pairs its extra (kept) slots with evicted tail slots: those are
        # written onto themselves instead.
        dst = torch.where(keep.gather(-1, holes), tail, holes)
        b, hkv, c = self.pos.shape
        for store in (self.keys.view(b, hkv, c, -1), self.values.view(b, hkv, c, -1), self.slot_data, self.pos[..., None]):
            if store.shape[-1]:
                rows = store.gather(2, tail[..., None].expand(-1, -1, -1, store.shape[-1]))
                store.scatter_(2, dst[..., None].expand(-1, -1, -1, store.shape[-1]), rows)
        self.pos[..., kept:] = -1

    def _within_tolerance(self) -> bool:
        """Whether the host knows that ``enforce`` would evict nothing now: a packed layer under an int quota
        whose heads hold no more than it plus the schedule's tolerance (amortised eviction between evictions)."""
        tolerance = self.cache.policy.schedule.tolerance
        return self.packed and isinstance(self._quota_source, int) and max(self.fill) <= self._least_quota + tolerance

    def enforce(self, stats: AttnStats | None) -> None:
        """The one eviction path: bring every sequence holding more than the policy's ``quota`` (plus its
        schedule's tolerance) back to it, with the policy's ``select``. Sequences within their quota are never
        touched, so a sequence gets the same result alone and in a batch. ``stats`` is None when a cross-layer
        decision enforces a layer other than the one that just attended."""
        policy = self.cache.policy
        schedule = policy.schedule
        quota = policy.quota(self, stats)
        if not (quota is self._quota_source or (isinstance(quota, int) and quota == self._quota_source)):
            # A new quota: its least entry is read once, then the host can tell when nobody is over it.
            self.quota = torch.as_tensor(quota, device=self.device).expand(self.batch_size, self.num_kv_heads).long()
            self._quota_source, self._least_quota = quota, int(self.quota.min())
        if self.packed:  # every sequence holds fill[h] tokens in head h: the host decides, without a sync
            if max(self.fill) <= self._least_quota + schedule.tolerance:
                return
            if isinstance(quota, int):  # then every sequence is over
                self.evict(policy.select(self, stats, self.quota), slack=schedule.slack)
                return
        over = (self.held() > self.quota + schedule.tolerance).any(-1)  # [B]
        if not bool(over.any()):
            return
        keep = policy.select(self, stats, self.quota)
        self.evict(torch.where(over[:, None, None], keep, self.valid), slack=schedule.slack)

    def step(self, stats: AttnStats) -> None:
        """Run the policy after this layer's attention: ``observe``, ``enforce`` when the schedule says so,
        ``after_layer``."""
        policy = self.cache.policy
        policy.observe(self, stats)
        schedule = policy.schedule
        if stats.phase is Phase.PREFILL:
            due = schedule.prefill
        else:
            self.decode_steps += 1
            due = schedule.decode_every > 0 and self.decode_steps % schedule.decode_every == 0
        if due:
            self.enforce(stats)
        policy.after_layer(self, stats)

    # ------------------------------------------------------------------ attention
    def attend(
        self,
        query: torch.Tensor,
        scale: float,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Store the staged tokens, attend ``query`` over the slots, let the policy evict. Returns ``[B, q, H, D]``."""
        if self._pending is None:
            raise RuntimeError(f"layer {self.layer_idx}: attention called without a preceding cache update")
        key_states, value_states = self._pending
        self._pending = None
        self.cache.release_pending()
        b, h, n, _ = query.shape
        phase = self.phase(n)
        q_pos, q_real = self._query_positions(b, n, attention_mask, position_ids, query.device)
        was_empty = n > 1 and (self.max_slots == 0 or (self.packed and max(self.fill) == 0))
        all_real = attention_mask is None or bool(q_real.all())
        slots = self.insert(
            key_states, value_states, q_pos if all_real else torch.where(q_real, q_pos, torch.full_like(q_pos, -1)), all_real
        )
        self.seen += n

        policy = self.cache.policy
        request = policy.stats_request(phase)
        if phase is Phase.DECODE and policy.decode_stats_for_eviction_only and self._within_tolerance():
            request = NO_STATS  # nothing will read them: this step evicts nothing
        stats = AttnStats(phase=phase, new_slots=slots)
        keys, shift = self.keys, policy.position_shift(self, q_pos)
        if shift is not None:  # attend at shifted positions; storage keeps the original rotation
            rotary, key_delta, query_delta = shift
            if not self.uniform:
                raise NotImplementedError("position shifting needs as many slots in every head")
            query = shift_rotary(query, query_delta[:, None, :], rotary)
            dense = self.keys.view(b, self.num_kv_heads, self.max_slots, -1)
            keys = shift_rotary(dense, key_delta, rotary).reshape(self.keys.shape)
        fill = self.dense_fill
        if n == 1 and request.empty and shift is None and fill is not None:
            # Nothing to measure and every slot below fill holds a visible token: sdpa over a slice of storage.
            c = self.max_slots
            out = torch.nn.functional.scaled_dot_product_attention(
                query, self.keys.view(b, self.num_kv_heads, c, -1)[:, :, :fill],
                self.values.view(b, self.num_kv_heads, c, -1)[:, :, :fill], scale=scale, enable_gqa=h != self.num_kv_heads,
            )
        elif n == 1 and request.empty and shift is None and self.packed:
            out = self._decode_packed_heads(query, scale)
        elif n == 1:
            out = self._decode(query, keys, scale, request, stats)
        else:
            if was_empty and all_real and self.uniform and shift is None and request.colsum:
                # Nothing held before and no padding: causal attention over the new tokens, whose probabilities
                # give the column sums in the same pass.
                out, colsum = kernels.causal_attention_colsum(query, key_states, value_states, scale)
                colsum = torch.nn.functional.pad(colsum, (0, self.max_slots - n))
                stats.colsum = kernels.group_reduce(colsum, self.num_kv_heads, request.reduce)
            elif was_empty and all_real and self.uniform and shift is None:
                # Nothing held before and no padding: plain causal attention over the new tokens.
                out = torch.nn.functional.scaled_dot_product_attention(
                    query, key_states, value_states, is_causal=True, scale=scale, enable_gqa=h != self.num_kv_heads
                )
            else:
                out = self._masked(query, keys, scale, torch.where(q_real, q_pos, torch.full_like(q_pos, _POS_BIG)))
            self._prefill_stats(query, keys, scale, q_pos, q_real, request, stats)
        if not all_real:
            out = out * q_real[:, None, :, None].to(out.dtype)
        self.step(stats)
        return out.transpose(1, 2).contiguous()

    @property
    def dense_fill(self) -> int | None:
        """When storage is a dense ``[B, H_kv, C, D]`` whose first ``fill`` slots of every head and sequence hold
        tokens and the rest are free: that ``fill``; else None."""
        if self.packed and self.uniform and len(set(self.fill)) == 1:
            return self.fill[0]
        return None

    def phase(self, n: int) -> Phase:
        """The phase of a call bringing ``n`` tokens, from what this layer has seen, not from ``n`` alone.

        The first call is the prompt (a one-token prompt too); later calls continue the prompt in chunks until
        the first single-token call, the first decode step; from then on every call is a decode step
        (speculative decoding and assisted generation verify several tokens in one).
        """
        if self.seen and (n == 1 or self.decoding):
            self.decoding = True
            return Phase.DECODE
        return Phase.PREFILL

    def _query_positions(
        self,
        b: int,
        n: int,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``[B, n]`` of the new tokens and whether each is real (not padding)."""
        if position_ids is not None:
            q_pos = position_ids.to(device=device, dtype=torch.int64).reshape(-1, n).expand(b, n)
        else:
            q_pos = (torch.arange(n, device=device) + self.seen).expand(b, n)
        if attention_mask is None:
            q_real = torch.ones((b, n), dtype=torch.bool, device=device)
        else:
            if attention_mask.dim() != 4:
                raise ValueError(f"expected a 4-D attention mask from the 'kvgates' mask function, got {attention_mask.dim()}-D")
            # Token i of this forward sits in mask column seen + i; its own column is masked iff it is padding.
            cols = torch.arange(n, device=device) + self.seen
            diag = attention_mask[:, 0, torch.arange(n, device=device), cols]
            q_real = diag if diag.dtype == torch.bool else diag > torch.finfo(diag.dtype).min / 2
            q_real = q_real.expand(b, n)
        return q_pos.contiguous(), q_real.contiguous()

    def _decode(self, query: torch.Tensor, keys: torch.Tensor, scale: float, request, stats: AttnStats) -> torch.Tensor:
        b, h, _, _ = query.shape
        hkv, fill = self.num_kv_heads, self.dense_fill
        reduce = "none" if request.reduce == "max" else "sum"
        dense = fill is not None and kernels.backend(query) == "reference"
        if dense:  # the torch kernel over the held slice (the Triton kernel reads the flat storage as it is)
            c = self.max_slots
            out, probs = kernels.decode_attention(
                query[:, :, 0], keys.view(b, hkv, c, -1)[:, :, :fill], self.values.view(b, hkv, c, -1)[:, :, :fill],
                None, scale, reduce=reduce,
            )
        else:
            out, probs = kernels.decode_attention_flat(query[:, :, 0], keys, self.values, self.pos, self.head_slots, scale, reduce=reduce)
        if not request.empty:
            if request.reduce == "max":
                probs = kernels.group_reduce(probs, hkv, "max")
            elif request.reduce == "mean":
                probs = probs / (h // hkv)
            if dense:  # over every slot; free slots (at and past fill) stay 0
                if "probs" not in self._derived:
                    self._derived["probs"] = probs.new_zeros((b, hkv, self.max_slots))
                self._derived["probs"][..., :fill] = probs
                probs = self._derived["probs"]
            stats.rows = probs[:, :, None]
            stats.window = probs if request.window else None
            stats.window_rows = 1
            stats.colsum = probs
        return out[:, :, None]

    def _decode_packed_heads(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode attention without statistics for a packed layer whose heads hold different numbers of tokens
        (Ada-KV's head budgets, KVMerger's merges): every slot below a head's ``fill`` is visible. Query heads
        attend their KV head through sdpa's GQA (faster than as query rows of one head). Uniform storage: one
        sdpa over the slots below the largest fill with ``_fill_mask``; ragged storage: one sdpa per head over its
        held slice. No search over positions, no host sync. Returns ``[B, H, 1, D]``."""
        b, h, _, d = query.shape
        hkv = self.num_kv_heads
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if self.uniform:
            c, m = self.max_slots, max(self.fill)
            keys, values = self.keys.view(b, hkv, c, -1)[:, :, :m], self.values.view(b, hkv, c, -1)[:, :, :m]
            return sdpa(query, keys, values, attn_mask=self._fill_mask(h // hkv), scale=scale, enable_gqa=h != hkv)
        groups = query.split(h // hkv, dim=1)
        heads = zip(groups, self._head_views(), self.fill)
        return torch.cat([sdpa(q, k[:, :, :f], v[:, :, :f], scale=scale, enable_gqa=h != hkv) for q, (k, v), f in heads], dim=1)

    def _head_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``head_views``' keys and values of ragged storage, ``[B, 1, slots, D]`` per head, kept until storage
        changes (keys and values are written in place until then; positions are not kept: eviction replaces them)."""
        if "head_views" not in self._derived:
            self._derived["head_views"] = [(k, v) for _, k, v, _ in self.head_views()]
        return self._derived["head_views"]

    def _masked(self, query: torch.Tensor, keys: torch.Tensor, scale: float, q_pos: torch.Tensor) -> torch.Tensor:
        g = query.shape[1] // self.num_kv_heads
        outs = []
        for heads, k, v, pos in kernels.dense_groups(keys, self.values, self.pos, self.head_slots):
            q = query[:, heads.start * g : heads.stop * g]
            outs.append(kernels.masked_attention(q, k, v, pos, q_pos, scale))
        return torch.cat(outs, dim=1)

    def _per_group(self, fn, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Apply ``fn(q, k, pos) -> [B, h, ..., c]`` per head group and pad the slot axis to ``max_slots``."""
        g = query.shape[1] // self.num_kv_heads
        groups = kernels.dense_groups(keys, self.values, self.pos, self.head_slots)
        parts = [fn(query[:, heads.start * g : heads.stop * g], k, pos) for heads, k, _, pos in groups]
        cmax = self.max_slots
        return torch.cat([torch.nn.functional.pad(p, (0, cmax - p.shape[-1])) for p in parts], dim=1)

    def _prefill_stats(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        scale: float,
        q_pos: torch.Tensor,
        q_real: torch.Tensor,
        request,
        stats: AttnStats,
    ) -> None:
        if request.empty:
            return
        n = query.shape[2]
        reduce = request.reduce
        if request.rows:
            r = min(request.rows, n)

            def rows(q, k, pos):
                p = kernels.attention_probs(q[:, :, n - r :], k, pos, q_pos[:, n - r :], scale)
                return kernels.group_reduce(p * q_real[:, None, n - r :, None], k.shape[1], reduce)

            stats.rows = self._per_group(rows, query, keys)
        if request.window:
            w = min(request.window, n)
            stats.window_rows = w
            q_win, pos_win, real_win = query[:, :, n - w :], q_pos[:, n - w :], q_real[:, n - w :]
            if reduce == "max":
                stats.window = self._per_group(
                    lambda q, k, pos: kernels.group_reduce(
                        (kernels.attention_probs(q, k, pos, pos_win, scale) * real_win[:, None, :, None]).sum(2),
                        k.shape[1],
                        "max",
                    ),
                    q_win,
                    keys,
                )
            else:
                stats.window = kernels.window_scores_flat(
                    q_win, keys, self.values, self.pos, self.head_slots, pos_win, real_win, scale, reduce
                )
        if request.colsum and stats.colsum is None:  # not already from the attention pass
            stats.colsum = self._per_group(
                lambda q, k, pos: kernels.group_reduce(
                    kernels.column_sums(q, k, pos, q_pos, q_real, scale), k.shape[1], reduce
                ),
                query,
                keys,
            )
