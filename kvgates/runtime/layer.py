"""One decoder layer's budgeted KV cache: the transformers cache-layer API and the policy step.

Storage (slots, insertion, eviction, packing) is ``kvgates.runtime.storage``; the attention paths are
``kvgates.runtime.dispatch``; the per-layer state types are ``kvgates.runtime.state``.

Vocabulary: a policy's ``budget`` is its parameter (tokens per KV head); a layer's ``quota`` ``[B, H_kv]`` is
what each head of each sequence may hold after the latest eviction (a budget after per-layer, per-sequence or
per-head adjustments); ``head_slots`` is storage (what is allocated, quota plus slack).

Policy step. After each attention call ``step`` runs the policy: ``observe`` (state updates), then, when its
``schedule`` says so, ``enforce`` — the one eviction path: ``quota``, and for the sequences holding more than
it, ``select`` (the keep mask), then ``evict`` — and finally ``after_layer`` (cross-layer decisions, which
``enforce`` other layers the same way). A static layer's decode step runs ``step_static`` instead: the same
hooks, with the eviction applied as a mask on every step (see ``BudgetCache``'s ``static``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvgates.kernels.host import HostRead, on_device
from kvgates.runtime.dispatch import EAGER_ONLY, AttentionDispatch
from kvgates.runtime.state import LayerState
from kvgates.runtime.stats import AttnStats, Phase
from kvgates.runtime.storage import KeptCounts, SlotStorage, head_range

if TYPE_CHECKING:
    from kvgates.runtime.cache import BudgetCache
    from kvgates.runtime.protocol import CachePolicy


class Handoff(threading.local):
    """The layer whose ``update()`` ran last in this thread and whose attention call is due.

    transformers calls the cache's ``update()`` and then the attention function, which does not receive the cache;
    this joins the two. A thread-local object rather than a context variable: ``torch.compile`` traces reads and
    writes of its attribute, where ``ContextVar.get`` breaks the graph.
    """

    layer: BudgetLayer | None = None


HANDOFF = Handoff()

#: Why ``crop`` (and ``BudgetCache.activate_past_recording``, which prepares it) is refused.
NOT_CROPPABLE = (
    "a BudgetCache cannot be cropped: evicted tokens cannot be restored (generate()'s assisted decoding and "
    "prompt lookup crop the cache after rejected draft tokens; run them with transformers' DynamicCache: a "
    "BudgetCache of the full policy cannot be cropped either)"
)


class BudgetLayer(SlotStorage, AttentionDispatch, CacheLayerMixin):
    """Budgeted KV storage of one layer; filled by ``update`` and attended by the ``"kvgates"`` attention."""

    is_sliding = False
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
        #: Whether a forward has brought padding: until one does, every sequence has seen ``seen`` real tokens, at
        #: positions ``0 .. seen - 1`` unless the caller gave others.
        self.padded = False
        self.decoding = False  # whether a decode step has run (see ``phase``)
        self.decode_steps = 0
        self.fill: list[int] = []  # per head: slots >= fill[h] are free (see "Packed layout")
        self.packed = False  # every slot below fill[h] is valid, in every sequence
        self.free_floor = 0  # free slots every head of every sequence has at least, known on the host
        self._quota_source: int | torch.Tensor | None = None  # the policy's quota ``quota`` was built from
        self._quota_range: tuple[list[int], list[int]] = ([], [])  # per head, its least and largest entry, on the host
        self.held_over_quota: int | None = None  # every head of every sequence holds its quota plus this, on the host
        self._policy_states: dict[int, LayerState] = {}
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._deferred: Callable[[], None] | None = None  # an eviction, or its compaction, for the next layer's end (``_defer``)
        self.is_compileable = cache.static  # decode steps compile once the prompt is stored (``static``)
        self.decoded: torch.Tensor | None = None  # static layout: decode steps not yet counted in ``seen`` (0-d)
        #: Static layout: ``seen`` and ``decode_steps`` as the host last counted them, ``[2]`` on the device, where a
        #: static step reads them (a host number read in a compiled step is guarded: it compiled again at each change).
        self.counted: torch.Tensor | None = None
        self.static_evictions = 0  # static layout: the most tokens a head may evict in one step (slots over its quota)
        self._derived: dict[str, Any] = {}  # layout-derived tensors and state views, dropped when storage changes

    def __repr__(self) -> str:
        return f"BudgetLayer(layer={self.layer_idx}, head_slots={self.head_slots}, seen={self.seen})"

    @property
    def static(self) -> bool:
        """Whether the layer has the static layout (see ``kvgates.runtime.storage``): its single-token decode
        steps run without host syncs (``_attend_static``, ``step_static``), and so does the policy's selection."""
        return self.decoded is not None

    @property
    def ragged(self) -> bool:
        """Whether heads may get different numbers of slots (the policy asks for ragged heads)."""
        return self.cache.policy.ragged_heads

    @property
    def is_last(self) -> bool:
        """Whether this is the cache's last budgeted layer (cross-layer decisions happen after it)."""
        return self.rank == self.cache.num_budget_layers - 1

    def policy_state(self, policy: CachePolicy) -> LayerState:
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
        self.fill, self.packed, self.free_floor = [0] * hkv, False, 0  # packed once written to (``_free_slots``) or compacted
        self.held_over_quota = None
        self.pos = torch.full((b, hkv, 0), -1, dtype=torch.int64, device=self.device)
        specs = self.cache.policy.slot_state()
        self._state_layout, offset = {}, 0
        for name, spec in specs.items():
            self._state_layout[name] = (offset, spec.shape)
            offset += spec.size
        init = [spec.init for spec in specs.values() for _ in range(spec.size)]
        self.state_init = on_device(init, self.device, torch.float32)
        self.slot_data = torch.zeros((b, hkv, 0, offset), dtype=torch.float32, device=self.device)
        self._derived = {}
        self._mark_order(True)  # (nothing held)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the new keys/values; the ``"kvgates"`` attention call that follows stores and attends them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cache.claim_pending(self.layer_idx)
        self._pending = (key_states, value_states)
        HANDOFF.layer = self
        return key_states, value_states

    def staged(self, layer_idx: int | None, key_states: torch.Tensor) -> bool:
        """Whether ``key_states`` of layer ``layer_idx`` are the tokens this layer staged for attention."""
        return layer_idx == self.layer_idx and self._pending is not None and self._pending[0] is key_states

    def get_seq_length(self) -> int:
        """Tokens *seen* (padding included), which generate() uses to place the next token."""
        return self.seen + (int(self.decoded) if self.static else 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask transformers builds for a call of ``query_length`` tokens: every token
        seen and the new ones. A static layer's single-token decode step reads no mask (its slots' positions say what
        is visible), and gets one column whatever the tokens seen: a mask as wide as them, a new shape at every prompt
        length, made generate()'s compiled step (``dynamic=False``) compile again for each."""
        if self.static and query_length == 1:
            return 1, 0
        if self.static:  # a chunk after static decode steps: their count back on the host
            self._fold_decoded()
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.pos = self.slot_data = self.quota = None
        self.head_slots, self._policy_states = [], {}
        self.fill, self.packed, self._quota_source, self.free_floor = [], False, None, 0
        self._quota_range, self.held_over_quota = ([], []), None
        self.seen, self.decoding, self.decode_steps, self._pending, self.decoded, self.counted = 0, False, 0, None, None, None
        self.padded = False
        self._deferred = None
        self._derived = {}
        self.is_initialized = False

    def _select_batch(self, fn) -> None:
        """Apply a batch selection (beam reordering, repetition) to every per-sequence value: storage, positions,
        per-slot state, the quota and the tensors of every policy's layer state. A static layer's selection that
        keeps the batch size (a beam reorder) writes its storage in place: the tensors ``settle`` marked as static
        addresses keep them, so a CUDA graph captured from the compiled decode step replays instead of recording
        again (the quota and the policy's values, which the layer may share with its policy, are new tensors)."""
        if not self.is_initialized:
            return
        ordered = self.in_position_order  # each sequence's slots stay as they were
        stores = (self.keys, self.values, self.pos, self.slot_data)
        selected = [fn(t) for t in stores]
        if self.static and all(new.shape == old.shape for new, old in zip(selected, stores)):
            selected = [old.copy_(new) for new, old in zip(selected, stores)]
        self.keys, self.values, self.pos, self.slot_data = selected
        if self.quota is not None:
            self.quota = fn(self.quota)
        for state in self._policy_states.values():
            state.select_batch(fn)
        self.batch_size = self.keys.shape[0]
        self._derived, self.held_over_quota = {}, None
        self._mark_order(ordered)
        if self.static:  # (new tensors, where the batch size changed: marked as static addresses again)
            self.settle(self.max_slots)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_batch(lambda t: t[indices.to(t.device)])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(NOT_CROPPABLE)

    # ------------------------------------------------------------------ policy step
    @property
    def most_held(self) -> int | None:
        """The most tokens a head of a sequence holds, known on the host (a packed layer's largest ``fill``); None
        where only the device knows (unpacked)."""
        return max(self.fill) if self.packed and self.fill else None

    @property
    def _least_quota(self) -> int:
        """The least entry of ``quota``, on the host (with a quota set)."""
        return min(self._quota_range[0])

    @property
    def over_quota_bound(self) -> int | None:
        """How many tokens a head of a sequence may hold beyond its entry of ``quota``, at most, known on the host
        (``held_over_quota``, or ``most_held`` and the quota's least entry); None where only the device knows."""
        if self.held_over_quota is not None:
            return self.held_over_quota
        most = self.most_held
        return None if most is None or self._quota_source is None else most - self._least_quota

    def _within_tolerance(self) -> bool:
        """Whether the host knows that ``enforce`` would evict nothing now: a packed layer under an int quota
        whose heads hold no more than it plus the schedule's tolerance (amortised eviction between evictions)."""
        tolerance = self.cache.policy.schedule.tolerance
        return self.packed and isinstance(self._quota_source, int) and max(self.fill) <= self._least_quota + tolerance

    def quota_tensor(self, quota: int | torch.Tensor) -> torch.Tensor:
        """The policy's ``quota`` (an int, or per sequence and head) as ``[B, H_kv]`` int64 on the layer's device."""
        if isinstance(quota, int):
            return torch.full((self.batch_size, self.num_kv_heads), quota, dtype=torch.long, device=self.device)
        return quota.to(self.device).expand(self.batch_size, self.num_kv_heads).long()

    def enforce(
        self, stats: AttnStats | None, quota: int | torch.Tensor | None = None, known: tuple[list[int], list[int]] | None = None,
        later: bool = False,
    ) -> None:
        """The one eviction path: bring every sequence holding more than the policy's ``quota`` (plus its
        schedule's tolerance) back to it, with the policy's ``select``. Sequences within their quota are never
        touched, so a sequence gets the same result alone and in a batch. ``stats`` is None when a cross-layer
        decision enforces a layer other than the one that just attended. ``quota``: the policy's, already asked
        for (``_defer``), with its range per head ``known`` (else the range is read back). ``later``: a compaction
        that must read back what the selection keeps may wait for the next layer's end (``_defer``)."""
        if self._everyone_over(stats, quota, known):
            self._evict_everyone(stats, later=later)

    def _everyone_over(
        self, stats: AttnStats | None, quota: int | torch.Tensor | None = None, known: tuple[list[int], list[int]] | None = None
    ) -> bool:
        """``enforce`` up to its selection where the host knows that every sequence is over its quota: True when it
        is (``_evict_everyone`` is then due), else the eviction done, if any (False)."""
        policy = self.cache.policy
        schedule = policy.schedule
        quota = policy.quota(self, stats) if quota is None else quota
        if not self._is_quota(quota):
            # A new quota: its range per head is read once (an int's is known, and a policy may know a tensor's),
            # then the host can tell who is over.
            self.quota = self.quota_tensor(quota)
            if isinstance(quota, int):
                known = ([quota] * self.num_kv_heads,) * 2
            else:
                known = known or policy.quota_range(self, quota) or head_range(self.quota).tolist()
            self._quota_source, self._quota_range = quota, tuple(known)
            self.held_over_quota = None  # it was counted against the previous quota
        if self.held_over_quota is not None:  # every head holds its quota plus as many: everybody is over, or nobody
            return self.held_over_quota > schedule.tolerance
        if self.packed:  # every sequence holds fill[h] tokens in head h: the host decides, without a sync
            least, most = self._quota_range
            if all(f <= q + schedule.tolerance for f, q in zip(self.fill, least)):  # nobody is over
                return False
            if any(f > q + schedule.tolerance for f, q in zip(self.fill, most)):  # every sequence is over in a head
                return True
        held = self.held()
        over = (held > self.quota + schedule.tolerance).any(-1)  # [B]
        # One read: whether anybody is over, and whether every head ends at its quota (an exact selection's over ones).
        at_quota = torch.where(over[:, None], held >= self.quota, held == self.quota).all()
        anybody, full = torch.stack([over.any(), at_quota]).tolist()
        if anybody:
            # Sequences within tolerance are asked to keep what they hold: a selection with side effects (a merge of
            # the evicted tokens) leaves them as they would be alone.
            keep = policy.select(self, stats, torch.where(over[:, None], self.quota, torch.maximum(held, self.quota)))
            self.evict(torch.where(over[:, None, None], keep, self.valid), slack=schedule.slack)
        self.held_over_quota = 0 if full and (policy.exact_quota or not anybody) else None
        return False

    def _is_quota(self, quota: int | torch.Tensor) -> bool:
        """Whether ``quota`` is the one the layer's ``quota`` was built from (its range is on the host)."""
        return quota is self._quota_source or (isinstance(quota, int) and quota == self._quota_source)

    def _defer(self, stats: AttnStats) -> None:
        """``enforce(stats)`` for a prompt forward's layer before the last, where the host does not know the range of
        the policy's new quota: the range's copy to the host is queued now (``HostRead``), and the eviction runs at
        the end of the next layer's step (``end_deferred``), when the copy is long done. Reading it now made the host
        wait for the device to run everything queued, then the device wait for the eviction's launches; at the next
        layer's end the device still has that layer's work to run while the host evicts. Each layer is evicted as
        right away: its quota is asked for now and nothing else touches it in between (``Policy.cross_layer`` is
        False). Where the range is known, it evicts now. (The layer holds its whole prompt a layer longer: at the peak,
        one layer's prompt keys and values more.)"""
        policy = self.cache.policy
        quota = policy.quota(self, stats)
        if isinstance(quota, int) or self._is_quota(quota) or policy.quota_range(self, quota) is not None:
            self.enforce(stats, quota, later=True)
            return
        ranges = HostRead(head_range(self.quota_tensor(quota)))

        def evict() -> None:
            least, most = ranges.tolist()
            self.enforce(stats, quota, (least, most))

        self._deferred = evict

    def end_deferred(self) -> None:
        """Run the eviction (or the compaction) ``_defer`` left for later, if any."""
        if self._deferred is not None:
            finish, self._deferred = self._deferred, None
            finish()

    def _evict_everyone(self, stats: AttnStats | None, keep: torch.Tensor | None = None, later: bool = False) -> None:
        """Evict every sequence (the host knows that each is over its quota) to the policy's selection (``keep``, when
        made already: ``enforce_layers``); an exact one evicts with counts known on the host, and one that leaves every
        head at its quota starts the count of ``held_over_quota``. ``later``: where the host does not know what the
        selection keeps (KVMerger's pivots depend on the data), its range's copy to the host is queued now and the
        compaction, which needs it, runs at the next layer's end (``_defer``): the selection's launches then hide
        behind the next layer's work instead of the host waiting for them here."""
        policy = self.cache.policy
        counts = self.exact_counts() if policy.exact_quota else None
        keep = policy.select(self, stats, self.quota) if keep is None else keep
        if later and counts is None:
            keep = keep & self.valid
            kept = HostRead(head_range(keep.sum(-1)))

            def compact() -> None:
                least, most = kept.tolist()
                self.evict(keep, slack=policy.schedule.slack, kept_range=(least, most))

            self._deferred, self.held_over_quota = compact, None
            return
        self.evict(keep, slack=policy.schedule.slack, counts=counts)
        full = counts is not None and (counts.least, counts.most) == self._quota_range
        self.held_over_quota = 0 if full else None

    def exact_counts(self) -> KeptCounts | None:
        """Per head, what a sequence keeps and evicts under a selection of exactly ``min(held, quota)``
        (``Policy.exact_quota``), known on the host: from ``held_over_quota``, or a packed layer's ``fill`` against the
        quota's range; None where only the device knows."""
        if self._quota_source is None:
            return None
        least, most = self._quota_range
        if self.held_over_quota is not None:
            return KeptCounts(least, most, [self.held_over_quota] * self.num_kv_heads)
        if not self.packed:
            return None
        kept = [min(f, q) for f, q in zip(self.fill, least)]
        return KeptCounts(kept, [min(f, q) for f, q in zip(self.fill, most)], [f - k for f, k in zip(self.fill, kept)])

    def step(self, stats: AttnStats) -> None:
        """Run the policy after this layer's attention: ``observe``, ``enforce`` when the schedule says so,
        ``after_layer``."""
        policy = self.cache.policy
        policy.observe(self, stats)
        schedule = policy.schedule
        if stats.phase is Phase.PREFILL:
            due = schedule.prefill
        else:  # a call of several tokens (a new turn of a conversation) is due whatever the count, as a prompt chunk is
            self.decode_steps += 1
            several = stats.new_slots.shape[-1] > 1
            due = schedule.decode_every > 0 and (several or self.decode_steps % schedule.decode_every == 0)
        if due and stats.phase is Phase.PREFILL and not self.is_last and not policy.cross_layer:
            self._defer(stats)
        elif due:
            self.enforce(stats)
        policy.after_layer(self, stats)
        if stats.phase is Phase.PREFILL and self.rank:  # (the last layer's own eviction ran already: the forward ends evicted)
            self.cache.budget_layers[self.rank - 1].end_deferred()
        if self.cache.static and self.is_last and (schedule.prefill or schedule.decode_every or stats.phase is Phase.DECODE):
            # Every layer settles once the forward's last evictions are made (cross-layer budgets are decided after
            # the last layer). After a prompt forward, a policy that evicts neither then nor while decoding (KVzip:
            # its scoring pass evicts the prompt) is settled by what evicts for it (``runtime.scoring``).
            for layer in self.cache.budget_layers:
                layer.settle_static()
        self.cache.layer_done(self.layer_idx)

    # ------------------------------------------------------------------ static layout
    def settle_static(self) -> None:
        """Give the layer its static layout: the policy's largest quota plus the slots decoding needs before the
        next eviction (the schedule's slack; the cache's ``decode_slots`` for a policy that evicts only the prompt)."""
        policy = self.cache.policy
        schedule = policy.schedule
        quota = policy.quota(self, None)
        # Contiguous, as a batch selection (a beam reorder) leaves it: an expanded view of a per-sequence quota
        # (D2O's ``[B, 1]``) had other strides, and the compiled step recompiled after the first reorder.
        self.quota = self.quota_tensor(quota).contiguous()
        most, least = (quota, quota) if isinstance(quota, int) else (int(self.quota.max()), int(self.quota.min()))
        self.settle(most + (schedule.slack if schedule.decode_every else self.cache.decode_slots))
        self.static_evictions = self.max_slots - least
        if policy.state_type is not None:
            self.policy_state(policy)  # created here, not in a compiled step
        if self.decoded is None:
            self.decoded = torch.zeros((), dtype=torch.int64, device=self.device)
            self.counted = torch.zeros(2, dtype=torch.int64, device=self.device)
            for counter in (self.decoded, self.counted):
                torch._dynamo.mark_static_address(counter)
        self._count()

    def _count(self) -> None:
        """Copy ``seen`` and ``decode_steps`` to ``counted``, for the static steps to come."""
        self.counted.copy_(on_device([self.seen, self.decode_steps], self.device))

    @torch.compiler.disable(reason=EAGER_ONLY)
    def _fold_decoded(self) -> None:
        """Count the static decode steps taken since the last call on the host (before a call the static path
        does not take; one host sync, so never compiled)."""
        steps = int(self.decoded)
        self.seen, self.decode_steps = self.seen + steps, self.decode_steps + steps
        self.decoded.zero_()
        self._count()
        self.free_floor = 0  # static steps took free slots (``write_free``) without the host counting them
        self.held_over_quota = None

    def step_static(self, stats: AttnStats) -> None:
        """``step`` for a static decode step: ``observe``, then the schedule's eviction as a mask (every sequence
        over its quota plus tolerance on a due step keeps the policy's ``select``, in place), ``after_layer``. The
        selection runs on every step and applies where due and over: no host branch on data."""
        policy = self.cache.policy
        schedule = policy.schedule
        policy.observe(self, stats)
        if schedule.decode_every:
            over = (self.held() > self.quota + schedule.tolerance).any(-1)  # [B]
            if schedule.decode_every > 1:
                over = over & ((self.counted[1] + self.decoded) % schedule.decode_every == 0)
            # A sequence not due selects with a quota of every slot: it keeps what it holds, and a policy that
            # changes what it keeps (D2O's merges) changes nothing there.
            self.drop(policy.select(self, stats, torch.where(over[:, None], self.quota, self.max_slots)))
        policy.after_layer(self, stats)

    def phase(self, n: int) -> Phase:
        """The phase of a call bringing ``n`` tokens, from what this layer has seen, not from ``n`` alone.

        The first call is the prompt (a one-token prompt too); later calls continue the prompt in chunks until
        the first single-token call, the first decode step; from then on every call is a decode step (a call
        verifying several draft tokens too; generate()'s own assisted decoding, which crops the cache, is refused first).
        """
        if self.seen and (n == 1 or self.decoding):
            if n > 1 and self.rank == 0:
                self.cache.several_after_decoding(n)
            self.decoding = True
            return Phase.DECODE
        return Phase.PREFILL


def enforce_layers(layers: list[BudgetLayer]) -> None:
    """``layer.enforce(None)`` for each of ``layers`` (a decision across layers), with the selections of the layers
    whose every sequence is over made at once (``Policy.select_layers``: D2O's, in a few launches on a GPU, where one
    layer's after another's waited for the host). Each layer ends as enforced alone: its decision and eviction are
    its own, and a selection reads only its own layer."""
    over = [layer for layer in layers if layer._everyone_over(None)]
    if over:
        for layer, keep in zip(over, over[0].cache.policy.select_layers(over)):
            layer._evict_everyone(None, keep)
