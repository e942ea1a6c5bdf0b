"""Attention dispatch of one budgeted layer: which attention computes a call (sdpa over a slice of storage,
sdpa with a fill mask, the decode kernel with per-slot probabilities, causal attention with column sums, masked
attention over slots) and the statistics the policy asked for, in the prompt and in decode steps."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvgates import kernels
from kvgates.runtime.rope import shift_rotary
from kvgates.runtime.stats import NO_STATS, AttnStats, Phase, StatsRequest
from kvgates.runtime.storage import POS_BIG

#: sdpa's backends for decode attention on CUDA: all but cuDNN's, which sdpa prefers on an H100 for bf16. On an H100
#: (torch 2.11) cuDNN's attention failed on KVMerger's fill mask (a slice of a ruler at any offset: "misaligned
#: address"), which the memory-efficient kernel pads itself; and it builds a plan per shape and stride (other
#: projects found one built for every new decode length), the likely cause of single decode steps of AdaKV,
#: PyramidKV and DynamicKV (heads or layers at different lengths, each new every step) taking 0.6-7 s there at 16
#: layers (the issue's baseline saw PyramidKV's repeats at lengths seen before at 21 ms).
DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

#: Why a call other than a static layer's single-token decode step runs eagerly inside ``torch.compile``: a graph
#: break there (the default ``fullgraph=False``, which ``generate()``'s chunked prefill compiles with), and under
#: ``fullgraph=True`` dynamo's refusal, which quotes it.
EAGER_ONLY = (
    "a BudgetCache's prompts, prompt chunks and multi-token calls run eagerly; only a static cache's single-token "
    "decode steps compile (generate() compiles prompt chunks, prefill_chunk_size, for a compileable cache: compile "
    "without fullgraph=True there)"
)


def decode_backends(device: torch.device) -> AbstractContextManager:
    """Where decode attention's sdpa calls run: on CUDA within ``sdpa_kernel(DECODE_BACKENDS)`` (compiles with
    ``fullgraph=True``), elsewhere as sdpa picks (the CPU has no cuDNN backend; entering the context costs ~13 us)."""
    return sdpa_kernel(DECODE_BACKENDS) if device.type == "cuda" else nullcontext()


def decode_sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``scaled_dot_product_attention`` of a decode ``query`` over ``keys``/``values`` (under ``mask`` if given), GQA
    when the head counts differ, within ``decode_backends``."""
    with decode_backends(query.device):
        return torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != keys.shape[1]
        )


def real_tokens(attention_mask: torch.Tensor, seen: int, n: int) -> torch.Tensor:
    """Which of a forward's ``n`` new tokens are real (not padding), ``[B or 1, n]`` bool, from its 4-D attention mask
    ``[B or 1, 1, n, >= seen + n]`` (bool, or additive float) after ``seen`` tokens: token ``i`` sits in column
    ``seen + i``, and its own column is masked iff it is padding."""
    rows = torch.arange(n, device=attention_mask.device)
    diag = attention_mask[:, 0, rows, rows + seen]
    return diag if diag.dtype == torch.bool else diag > torch.finfo(diag.dtype).min / 2


class AttentionDispatch:
    """The attention paths of ``BudgetLayer`` (a base of it; storage comes from ``SlotStorage``)."""

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
        if self.static and query.shape[2] == 1:  # a decode step: a static layer holds a prompt (``phase``, not read:
            self.decoding = True  # its test of ``seen`` would make a compiled step recompile for every prompt length)
            return self._attend_static(query, key_states, value_states, scale, position_ids)
        return self._attend_eager(query, key_states, value_states, scale, attention_mask, position_ids)

    @torch.compiler.disable(reason=EAGER_ONLY)
    def _attend_eager(
        self,
        query: torch.Tensor,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        scale: float,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """``attend`` for every call but a static layer's decode step: host-side decisions on what the layer holds,
        so never compiled (``EAGER_ONLY``)."""
        b, h, n, _ = query.shape
        if self.static:
            self._fold_decoded()  # several tokens: the general path, with the counters back on the host
        phase = self.phase(n)
        q_pos = self._query_positions(b, n, position_ids, query.device)
        q_real, all_real = self._real_queries(b, n, attention_mask, query.device)
        was_empty = n > 1 and (self.max_slots == 0 or (self.packed and max(self.fill) == 0))
        slots = self.insert(
            key_states, value_states, q_pos if all_real else torch.where(q_real, q_pos, torch.full_like(q_pos, -1)), all_real
        )
        self.seen += n
        self.padded = self.padded or not all_real

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
            out = decode_sdpa(
                query, self.keys.view(b, self.num_kv_heads, c, -1)[:, :, :fill], self.values.view(b, self.num_kv_heads, c, -1)[:, :, :fill], scale
            )
        elif n == 1 and request.empty and shift is None and self.packed:
            out = self._decode_packed_heads(query, scale)
        elif n == 1:
            out = self._decode(query, keys, scale, request, stats)
        else:
            if q_real is None:  # the prompt's paths weigh query rows by it
                q_real = torch.ones((b, n), dtype=torch.bool, device=query.device)
            if was_empty and all_real and self.uniform and shift is None and (request.colsum or request.window):
                # Nothing held before and no padding: causal attention over the new tokens, whose probabilities
                # give the column sums and window scores in the same pass.
                out, colsum, window = kernels.causal_attention_stats(
                    query, key_states, value_states, scale, request.colsum, request.window
                )
                for name, per_head in (("colsum", colsum), ("window", window)):
                    if per_head is not None:
                        per_head = torch.nn.functional.pad(per_head, (0, self.max_slots - n))
                        setattr(stats, name, kernels.group_reduce(per_head, self.num_kv_heads, request.reduce))
                stats.window_rows = min(request.window, n)
            elif was_empty and all_real and self.uniform and shift is None:
                # Nothing held before and no padding: plain causal attention over the new tokens.
                out = torch.nn.functional.scaled_dot_product_attention(
                    query, key_states, value_states, is_causal=True, scale=scale, enable_gqa=h != self.num_kv_heads
                )
            else:
                out = self._masked(query, keys, scale, torch.where(q_real, q_pos, torch.full_like(q_pos, POS_BIG)), q_real, request, stats)
            self._prefill_stats(query, keys, scale, q_pos, q_real, request, stats)
        if not all_real:
            out = out * q_real[:, None, :, None].to(out.dtype)
        self.step(stats)
        return out.transpose(1, 2).contiguous()

    def _query_positions(self, b: int, n: int, position_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """Positions ``[B, n]`` of the new tokens."""
        if position_ids is not None:
            return position_ids.to(device=device, dtype=torch.int64).reshape(-1, n).expand(b, n).contiguous()
        return (torch.arange(n, device=device) + self.seen).expand(b, n).contiguous()

    def _real_queries(self, b: int, n: int, attention_mask: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor | None, bool]:
        """Whether each new token is real (not padding) ``[B, n]``, and whether all are: None and True without a mask
        (a decode step needs no tensor saying so). Whether all are is read back once a forward: its layers share one
        mask (``BudgetCache.real_queries``), and a read a layer made the host wait for the device at every layer."""
        if attention_mask is None:
            return None, True
        if attention_mask.dim() != 4:
            raise ValueError(f"expected a 4-D attention mask from the 'kvgates' mask function, got {attention_mask.dim()}-D")

        def read() -> tuple[torch.Tensor, bool]:
            q_real = real_tokens(attention_mask, self.seen, n).to(device).expand(b, n).contiguous()
            return q_real, bool(q_real.all())

        return self.cache.real_queries(attention_mask, (self.seen, b, n, device), read)

    def _decode(self, query: torch.Tensor, keys: torch.Tensor, scale: float, request: StatsRequest, stats: AttnStats) -> torch.Tensor:
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
            probs = self._reduce_probs(probs, request, h)
            if dense:
                probs = self._dense_probs(probs, fill)
            self._decode_stats(stats, probs, request)
        return out[:, :, None]

    def _dense_probs(self, probs: torch.Tensor, fill: int) -> torch.Tensor:
        """A dense layer's decode probabilities ``[B, H_kv, fill]`` over every slot: free slots (at and past
        ``fill``) read 0. One buffer is kept until storage changes, with how far the last step wrote; only the
        slots a larger earlier fill left written are cleared (an eviction shrinks ``fill``), so a per-step
        eviction's next step writes its row and clears nothing."""
        buffer, written = self._derived.get("probs", (None, 0))
        if buffer is None:
            buffer = probs.new_zeros((*probs.shape[:2], self.max_slots))
        elif written > fill:
            buffer[..., fill:written] = 0
        buffer[..., :fill] = probs
        self._derived["probs"] = (buffer, fill)
        return buffer

    def _reduce_probs(self, probs: torch.Tensor, request: StatsRequest, heads: int) -> torch.Tensor:
        """A decode query's probabilities (per query head for ``max``, else summed over each GQA group) reduced to
        KV heads as ``request`` asks."""
        if request.reduce == "max":
            return kernels.group_reduce(probs, self.num_kv_heads, "max")
        if request.reduce == "mean":
            return probs / (heads // self.num_kv_heads)
        return probs

    @staticmethod
    def _decode_stats(stats: AttnStats, probs: torch.Tensor, request: StatsRequest) -> None:
        """Every statistic of a decode step is its one query's probabilities ``[B, H_kv, C]``."""
        stats.rows = probs[:, :, None]
        stats.window = probs if request.window else None
        stats.window_rows = 1
        stats.colsum = probs

    def _attend_static(
        self, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, scale: float, position_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """A decode step of one token on a static layer: write it into a free slot, attend over every slot with
        visibility from positions, let the policy evict, all with fixed shapes and no host sync (what
        ``torch.compile(fullgraph=True)`` needs). The token is taken as real (generate's decode tokens are).
        Returns ``[B, 1, H, D]``."""
        b, h, _, _ = query.shape
        hkv, c = self.num_kv_heads, self.max_slots
        if position_ids is not None:
            q_pos = position_ids.to(device=query.device, dtype=torch.int64).reshape(-1, 1).expand(b, 1)
        else:
            q_pos = (self.decoded + self.counted[0]).expand(b, 1)
        slots = self.write_free(key_states, value_states, q_pos)
        self.decoded.add_(1)
        request = self.cache.policy.stats_request(Phase.DECODE)
        stats = AttnStats(phase=Phase.DECODE, new_slots=slots, static_step=True)
        keys, values = self.keys.view(b, hkv, c, -1), self.values.view(b, hkv, c, -1)
        if request.empty:
            out = decode_sdpa(query, keys, values, scale, self.valid[:, :, None].repeat_interleave(h // hkv, dim=1))
        else:
            reduce = "none" if request.reduce == "max" else "sum"
            out, probs = kernels.decode_attention(query[:, :, 0], keys, values, self.pos, scale, reduce=reduce)
            self._decode_stats(stats, self._reduce_probs(probs, request, h), request)
            out = out[:, :, None]
        self.step_static(stats)
        return out.transpose(1, 2).contiguous()

    def _decode_packed_heads(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode attention without statistics for a packed layer whose heads hold different numbers of tokens
        (Ada-KV's head budgets, KVMerger's merges): every slot below a head's ``fill`` is visible. Query heads
        attend their KV head through sdpa's GQA (faster than as query rows of one head). Uniform storage: one
        sdpa over the slots below the largest fill with ``_fill_mask``; ragged storage: one sdpa per head over its
        held slice. No search over positions, no host sync. Returns ``[B, H, 1, D]``."""
        b, h, _, d = query.shape
        hkv = self.num_kv_heads
        if self.uniform:
            c, m = self.max_slots, max(self.fill)
            keys, values = self.keys.view(b, hkv, c, -1)[:, :, :m], self.values.view(b, hkv, c, -1)[:, :, :m]
            return decode_sdpa(query, keys, values, scale, self._fill_mask(h // hkv))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        heads = zip(query.split(h // hkv, dim=1), self._head_views(), self.fill)
        with decode_backends(query.device):  # entered once for the layer's heads (~13 us an entry)
            return torch.cat([sdpa(q, k[:, :, :f], v[:, :, :f], scale=scale, enable_gqa=h != hkv) for q, (k, v), f in heads], dim=1)

    def _head_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``head_views``' keys and values of ragged storage, ``[B, 1, slots, D]`` per head, kept until storage
        changes (keys and values are written in place until then; positions are not kept: eviction replaces them)."""
        if "head_views" not in self._derived:
            self._derived["head_views"] = [(k, v) for _, k, v, _ in self.head_views()]
        return self._derived["head_views"]

    def _masked(
        self, query: torch.Tensor, keys: torch.Tensor, scale: float, q_pos: torch.Tensor, q_real: torch.Tensor,
        request: StatsRequest, stats: AttnStats,
    ) -> torch.Tensor:
        """Attention under position visibility; when ``request`` asks for ``colmax`` (else ``colsum``), it comes from
        the same softmax (``stats.colmax``, weighted by the policy's ``colmax_weights``; ``stats.colsum``)."""
        g = query.shape[1] // self.num_kv_heads
        outs, columns = [], []
        rows, cols = self.cache.policy.colmax_weights(self) if request.colmax else (None, None)
        for heads, k, v, pos in kernels.dense_groups(keys, self.values, self.pos, self.head_slots):
            q = query[:, heads.start * g : heads.stop * g]
            if request.colmax:
                weight = None if cols is None else cols[:, heads.start * g : heads.stop * g, : k.shape[2]]
                out, per_head = kernels.masked_attention_colmax(q, k, v, pos, q_pos, q_real, scale, rows, weight)
            elif request.colsum:
                out, per_head = kernels.masked_attention_colsum(q, k, v, pos, q_pos, q_real, scale)
            else:
                outs.append(kernels.masked_attention(q, k, v, pos, q_pos, scale))
                continue
            outs.append(out)
            per_head = kernels.group_reduce(per_head, k.shape[1], request.reduce)
            columns.append(torch.nn.functional.pad(per_head, (0, self.max_slots - per_head.shape[-1])))
        if request.colmax:
            stats.colmax = torch.cat(columns, dim=1)
        elif request.colsum:
            stats.colsum = torch.cat(columns, dim=1)
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
        request: StatsRequest,
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
        if request.window and stats.window is None:  # not already from the attention pass
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
        if request.colmax and stats.colmax is None:  # not already from the attention pass
            rows, cols = self.cache.policy.colmax_weights(self)
            best = self._per_group(lambda q, k, pos: kernels.column_max(q, k, pos, q_pos, q_real, scale, rows), query, keys)
            stats.colmax = kernels.group_reduce(best if cols is None else best * cols, self.num_kv_heads, reduce)
