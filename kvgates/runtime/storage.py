"""Slot storage of one budgeted layer: slots with positions and per-slot policy state, ragged head storage,
insertion, eviction with compaction, and the packed layout that lets a decode step append without a host sync.

Storage. Keys and values live in one flat buffer ``[B, S, D]`` per tensor; KV head ``h`` owns the slot range
``offsets[h] : offsets[h] + head_slots[h]``. When every head has as many slots (the usual case) the buffer is
exactly a dense ``[B, H_kv, C, D]`` tensor viewed flat; Ada-KV style per-head quotas give heads different
numbers of slots, and memory then follows the per-head quotas instead of the largest one. Slot positions and
per-slot policy state are small and kept padded to ``[B, H_kv, max_slots]``; a padded index
``j >= head_slots[h]`` does not exist and always reads as empty.

A slot is *valid* when its position is ``>= 0``. Positions never shift, and slot order says nothing about token
order: policies read positions, never slot indices. Where the host knows better, ``in_position_order`` says so:
after a prompt without padding is written into empty storage, and after an eviction that compacts (the kept tokens
go to the front of each head, in position order), each head's tokens are its first slots in position order until
a write that does not append (padding, moving tokens into holes, a static decode step) or one from outside.

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

Static layout (``BudgetCache(..., static=True)``). Once the prompt is stored, every head gets the same fixed
number of slots (``settle``), whose storage tensors keep their addresses from then on: a decode step writes its
token into the first free slot of each head (``write_free``) and evicts by clearing positions (``drop``), in place
and with fixed shapes, so that the step can be compiled (and captured as a CUDA graph).
"""

from __future__ import annotations

import copy
import math
from typing import NamedTuple

import torch

from kvgates import kernels
from kvgates.kernels.host import on_device
from kvgates.runtime.state import StateViews

#: A position past every token (sorts free slots last).
POS_BIG = torch.iinfo(torch.int64).max


class KeptCounts(NamedTuple):
    """What an eviction leaves, per head, known on the host: the least and the most tokens a sequence keeps, and
    the most it evicts."""

    least: list[int]
    most: list[int]
    evicted: list[int]


def head_range(values: torch.Tensor) -> torch.Tensor:
    """``[2, H_kv]``: a ``[B, H_kv]`` tensor's least and largest entry over the batch, per head."""
    return torch.stack([values.amin(0), values.amax(0)])


class SlotStorage:
    """Keys, values, positions and per-slot state of one layer, and the operations that write and evict them.

    A base of ``BudgetLayer``, which sets the shapes (``batch_size``, ``num_kv_heads``, ``device``, ``dtype``) and
    allocates empty storage on its first update (``lazy_initialization``) and holds the ``quota`` an eviction may be
    checked against and ``held_over_quota``, which writes count on; ``ragged`` says whether heads may get different
    numbers of slots after an eviction.
    """

    ragged = False

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

    # ------------------------------------------------------------------ layout
    @property
    def max_slots(self) -> int:
        """The most slots any head has (the padded slot axis of ``pos`` and ``state``)."""
        return max(self.head_slots) if self.head_slots else 0  # (no default=: torch.compile traces this form)

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
        """``[B, H_kv, C_max]`` slots holding a token (``pos >= 0``), computed once per state of ``pos``.

        A decode step asks for it several times (the selection, its forced slots, the eviction) while ``pos``
        stays as it is: the mask is kept with the ``pos`` tensor it was computed from and that tensor's version
        counter, which every in-place write bumps (through views too), and recomputed when either changed. Never
        modify the returned mask in place. Computed afresh where there is no counter (tensors made under
        ``torch.inference_mode``) and while ``torch.compile`` traces (the compiler merges the repeats itself)."""
        pos = self.pos
        if torch.compiler.is_compiling() or pos.is_inference():
            return pos >= 0
        held = self._derived.get("valid")
        if held is None or held[0] is not pos or held[1] != pos._version:
            held = (pos, pos._version, pos >= 0)
            self._derived["valid"] = held
        return held[2]

    @property
    def in_position_order(self) -> bool:
        """Whether the host knows that the tokens of each head of each sequence are its first slots, in ascending
        position order, and its other slots are free (a policy that reads tokens in position order may then skip
        sorting slots by position).

        Set by the writes that keep it (``insert`` appending tokens without padding to storage in order, storage
        growing, a batch selection) and by a compacting ``evict``; any other write loses it, one from outside the
        layer too: the mark is kept with the ``pos`` tensor and its version counter (as ``valid`` is), and holds
        only while both are unchanged. (Tensors made under ``torch.inference_mode`` have no counter: there the
        layer's own writes that break the order drop the mark, and writes from outside are not seen.) Positions
        are taken to ascend within a forward and past those held, as a causal model's positions do."""
        mark = self._derived.get("ordered")
        pos = self.pos
        return mark is not None and mark[0] is pos and (pos.is_inference() or mark[1] == pos._version)

    def _mark_order(self, ordered: bool) -> None:
        """Record whether each head's tokens are its first slots in position order (``in_position_order``), as of
        the ``pos`` tensor's present version."""
        if ordered:
            self._derived["ordered"] = (self.pos, None if self.pos.is_inference() else self.pos._version)
        else:
            self._derived.pop("ordered", None)

    def __deepcopy__(self, memo: dict) -> SlotStorage:
        """``copy.deepcopy``: a copy of every attribute but what is derived from storage (``_derived``), which the copy
        derives afresh from its own. A copied view shares the copy's storage but is no view of it: a static layer's
        per-slot state views, so copied, failed the inductor-compiled decode step built for views of ``slot_data``
        (an AssertionError from its generated code). And what is kept with ``pos``'s version counter (``valid``,
        ``in_position_order``) would hold for the copy once its new counter reached the original's count, whatever
        its positions then (a static cache copied after its first decode step read the token that step dropped as
        held, and found no free slot). The copy keeps the order mark where it holds now."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            if name != "_derived":
                setattr(twin, name, copy.deepcopy(value, memo))
        twin._derived = {}
        if "state" in self._derived:  # (built before a compiled step: ``settle``)
            twin._derived["state"] = twin._state_views()
        if self.in_position_order:
            twin._mark_order(True)
        return twin

    def exists(self) -> torch.Tensor:
        """``[H_kv, max_slots]`` padded slot indices that exist in each head's storage."""
        if "exists" not in self._derived:
            idx = torch.arange(self.max_slots, device=self.device)
            self._derived["exists"] = idx[None, :] < on_device(self.head_slots, self.device)[:, None]
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
            self._derived["offsets"] = on_device(self.offsets, self.device)[None, :, None]
        return index + self._derived["offsets"]

    def relayout(self, index: torch.Tensor, head_slots: list[int]) -> None:
        """Rebuild storage with ``head_slots`` slots per head: new slot ``j`` of head ``h`` takes old slot
        ``index[b, h, j]`` (see ``kernels.compact_slots``; an index past a head's old slots makes an empty slot)."""
        self.keys, self.values, self.pos, self.slot_data = kernels.compact_slots(
            self.keys, self.values, self.pos, self.slot_data, index, self.head_slots, list(head_slots), self.state_init
        )
        self.head_slots = list(head_slots)
        self.free_floor = 0  # unknown until counted (``evict`` knows it)
        self._derived = {}

    def _grow(self, extra: int) -> None:
        """Add ``extra`` empty slots after every head's slots: slice copies of the held storage (each head's
        segment followed by its new slots), no relayout, ragged or uniform."""
        b, ordered = self.batch_size, self.in_position_order

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
        self.free_floor += extra
        self._derived = {}
        self._mark_order(ordered)  # free slots after each head's own

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
            base = on_device(f0, self.device)[None, :, None]
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
            limit = on_device(f0, self.device)[:, None] + span
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
        if self.free_floor < n:  # the host cannot tell that every head has room: count (one read-back)
            free = ~self.valid & self.exists()[None]
            least = int(free.sum(-1).min()) if free.numel() else 0
            self.free_floor = least
            if least < n:
                self._grow(self._growth(n - least, n))
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
        # Storage in order has its free slots after each head's tokens, and the first of them are written: still in
        # order, unless some of the tokens are padding (free slots, between tokens, once written).
        ordered = self.in_position_order and all_real
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
        if self.held_over_quota is not None:  # every head of every sequence gained n tokens, unless some were padding
            self.held_over_quota = self.held_over_quota + n if all_real else None
        self.free_floor = min(c - f for c, f in zip(self.head_slots, self.fill)) if packed else self.free_floor - n
        self._mark_order(ordered)
        return slots

    def evict(
        self, keep: torch.Tensor, slack: int = 1, counts: KeptCounts | None = None,
        kept_range: tuple[list[int], list[int]] | None = None,
    ) -> None:
        """Drop every valid slot not in ``keep`` (``[B, H_kv, max_slots]`` bool) and compact each head's kept
        tokens to its first slots.

        After eviction each head has what it holds (max over the batch) plus ``slack`` free slots for the tokens
        that arrive before the next eviction (storage shrinks when oversized); heads have different numbers of
        slots only when the layer is ``ragged`` (the policy asks for ragged heads). Called by ``enforce``, and by
        ``scoring.discarded_forward`` to drop the tokens of a scoring forward.
        ``counts``: what each head keeps, when the host knows it because ``keep`` holds ``min(held, quota)`` tokens
        in every head of every sequence (``BudgetLayer.exact_counts``);
        that is checked on the device instead of the counts being read back, and the eviction then waits for nothing.
        ``kept_range``: else, the least and the most tokens each head keeps over the batch, read back already
        (``head_range`` of ``(keep & valid).sum(-1)``; ``BudgetLayer`` reads it while the device is busy).
        """
        fill, ordered = self.dense_fill, self.in_position_order
        valid = self.valid
        keep = keep & valid
        if counts is not None:  # what each head of each sequence keeps, min(held, quota): one number where all keep as many
            uniform = counts.least == counts.most and len(set(counts.most)) == 1
            expected = counts.most[0] if uniform else torch.minimum(valid.sum(-1), self.quota)
            torch._assert_async(
                (keep.sum(-1) == expected).all(), f"layer {self.layer_idx}: the policy kept other than min(held, quota) tokens"
            )
            least, most = counts.least, counts.most
        elif kept_range is not None:
            least, most = kept_range
        else:
            least, most = head_range(keep.sum(-1)).tolist()  # the eviction's one host sync
        need = [n + slack for n in most] if self.ragged else [max(most) + slack] * len(most)
        if fill is not None and least == most and len(set(most)) == 1 and need[0] >= self.max_slots:
            self._fill_holes(keep, fill, most[0])  # (it writes over every evicted slot's position)
            # In order still where nothing moved: nothing kept, or nothing evicted from storage in order.
            self._mark_order(most[0] == 0 or (ordered and most[0] == fill))
        else:
            self.pos = self.pos.masked_fill(~keep, -1)
            need = [min(n, c) for n, c in zip(need, self.head_slots)]
            order = self._kept_first(keep, max(need))
            self.relayout(order.contiguous(), need)
            self._mark_order(True)  # the kept tokens first, in position order
        self.fill, self.packed = most, least == most
        self.free_floor = min(c - m for c, m in zip(self.head_slots, most))
        self.held_over_quota = None  # (``enforce`` knows it again after an eviction to the quota)

    def _kept_first(self, keep: torch.Tensor, n: int) -> torch.Tensor:
        """``[B, H_kv, <= n]`` slot indices per head: the slots in ``keep`` first, in position order, then the others
        (the ``index`` of a ``relayout`` that keeps them)."""
        return torch.argsort(torch.where(keep, self.pos, POS_BIG), dim=-1, stable=True)[..., :n]

    def _fill_holes(self, keep: torch.Tensor, fill: int, kept: int) -> None:
        """Compact a dense layer in place when every head of every sequence keeps ``kept`` of its ``fill`` tokens:
        the tokens kept beyond slot ``kept`` move into the evicted slots below it (a decode eviction moves a few
        slots instead of rebuilding storage), and the slots from ``kept`` on are freed, so every evicted token's
        position is written over (``evict`` does not clear them first)."""
        moved = min(fill - kept, kept)
        b, hkv, c = self.pos.shape
        stores = [s for s in (self.keys.view(b, hkv, c, -1), self.values.view(b, hkv, c, -1), self.slot_data, self.pos[..., None]) if s.shape[-1]]
        if moved == fill - kept == 1:  # a decode step's eviction: the last slot moves into the hole, no sort
            dst = keep[..., :fill].min(-1, keepdim=True).indices  # the one evicted slot (the last: onto itself)
            for store in stores:
                store.scatter_(2, dst[..., None].expand(-1, -1, -1, store.shape[-1]), store[:, :, kept:fill].clone())
        elif moved:  # (none: nothing evicted, or nothing kept)
            holes = torch.argsort(keep[..., :kept].to(torch.uint8), dim=-1, stable=True)[..., :moved]  # evicted first
            tail = kept + torch.argsort((~keep[..., kept:fill]).to(torch.uint8), dim=-1, stable=True)[..., :moved]  # kept first
            # A row with fewer holes than ``moved`` pairs its extra (kept) slots with evicted tail slots: those are
            # written onto themselves instead.
            dst = torch.where(keep.gather(-1, holes), tail, holes)
            for store in stores:
                rows = store.gather(2, tail[..., None].expand(-1, -1, -1, store.shape[-1]))
                store.scatter_(2, dst[..., None].expand(-1, -1, -1, store.shape[-1]), rows)
        if kept < fill:
            self.pos[..., kept:] = -1

    @property
    def dense_fill(self) -> int | None:
        """When storage is a dense ``[B, H_kv, C, D]`` whose first ``fill`` slots of every head and sequence hold
        tokens and the rest are free: that ``fill``; else None."""
        if self.packed and self.uniform and len(set(self.fill)) == 1:
            return self.fill[0]
        return None

    # ------------------------------------------------------------------ static layout
    def settle(self, slots: int) -> None:
        """Give every head ``slots`` slots, its held tokens first (the static layout), and mark storage as static
        addresses for compiled decode steps. Raises when a head holds more than ``slots`` tokens."""
        held = int(self.held().amax()) if self.pos.numel() else 0
        if held > slots:
            raise ValueError(
                f"layer {self.layer_idx} holds {held} tokens in a head, more than its {slots} static slots (a call of "
                "several tokens after decoding began, a new turn, is kept whole): give the cache more decode_slots, or "
                "give the conversation so far as the prompt of a reset cache"
            )
        if self.head_slots != [slots] * self.num_kv_heads:
            order = self._kept_first(self.valid, slots)
            if order.shape[-1] < slots:  # indices past the old slots make empty slots
                more = torch.arange(self.max_slots, self.max_slots + slots - order.shape[-1], device=self.device)
                order = torch.cat([order, more.expand(*order.shape[:2], -1)], dim=-1)
            self.relayout(order.contiguous(), [slots] * self.num_kv_heads)
        self.fill, self.packed, self.free_floor = list(self.head_slots), False, 0  # decode steps fill slots unseen by the host
        self.held_over_quota = None
        self._derived = {"state": self._state_views()}  # built here, so that a compiled step finds them built
        if not torch.compiler.is_compiling():
            for tensor in (self.keys, self.values, self.pos, self.slot_data):
                torch._dynamo.mark_static_address(tensor)

    def write_free(self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Static layout: write one token per sequence (``[B, H_kv, 1, D]``, positions ``[B, 1]``) into the first
        free slot of each head, in place (a device-side assert fails when a head has none: a policy that evicts
        only the prompt decoded more tokens than its cache's ``decode_slots``). Returns the ``[B, H_kv, 1]`` slots
        written."""
        b, hkv, _, _ = key_states.shape
        c = self.max_slots
        free = ~self.valid
        torch._assert_async(free.any(-1).all(), "a static BudgetCache layer has no free slot (raise decode_slots)")
        slot = free.to(torch.uint8).argmax(-1, keepdim=True)
        for store, new in ((self.keys.view(b, hkv, c, -1), key_states), (self.values.view(b, hkv, c, -1), value_states)):
            store.scatter_(2, slot[..., None].expand(-1, -1, -1, store.shape[-1]), new.to(store.dtype))
        self.pos.scatter_(2, slot, positions[:, None, :].expand(b, hkv, 1))
        if self.slot_data.shape[-1]:
            f = self.slot_data.shape[-1]
            self.slot_data.scatter_(2, slot[..., None].expand(b, hkv, 1, f), self.state_init.expand(b, hkv, 1, f).clone())
        return slot

    def drop(self, keep: torch.Tensor) -> None:
        """Static layout: free every slot not in ``keep`` (``[B, H_kv, C]``), in place; storage stays as it is."""
        self.pos.masked_fill_(~keep, -1)
