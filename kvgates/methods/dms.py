"""DMS-style learned eviction (Łańcucki et al. 2025, "Inference-time hyper-scaling with KV cache compression":
Dynamic Memory Sparsification), in two variants: ``dms`` (decision heads on the frozen model, this project's
adapter design) and ``dms-lora`` (the model adapts too, through a LoRA trained with ``peft`` beside the heads).

What it is. Each gated layer has a decision head ``Linear(d_model -> H_kv)`` on the normed hidden state entering
attention; its output is one *eviction logit* per KV head and token, written when the token is. A token decided
"evict" is not dropped at once: it stays visible for ``window`` (w) more positions (*delayed eviction*), so the
recent context is never lost to a decision. The bias of each head starts at ``-gates.init_bias`` (the config's
``gates.init_bias``; by default 2, ``DecisionHeads.default_init_bias``; DMS's paper starts at -5), so at the start
little is evicted.

Training (``attend``, ``loss``). The student attends with the decisions relaxed by a Gumbel-sigmoid of
temperature ``method.temperature``: ``alpha_i = sigmoid((logit_i + g_i) / tau)``, ``g_i`` logistic noise (none in
eval mode), and query ``t`` sees key ``i`` with the additive bias ``log(1 - alpha_i)`` (computed as
``logsigmoid(-z_i)``: exact, finite, no clamp needed) only when ``t - i > w``; the ``w + 1`` most recent keys
(itself included) are never biased. The loss is the distillation of the frozen model, ``(KL + CE) / 2`` on the
completion tokens, plus ``loss.lambda_cap`` times a one-sided hinge ``max(0, target - mean alpha)`` per row (the
mean over the row's real tokens, layers and heads, as DMS sums its decisions over all heads). The target eviction
fraction is ``1 - budget / length``: a head of a row of ``length`` tokens that keeps ``budget`` of them has evicted
that fraction, and DMS's target compression ratio ``CR`` is ``length / budget`` (its target fraction
``1 - 1 / CR``). ``budget`` is the run's *ramped* budget (``loss.budget_ramp_steps`` takes it from
``data.seq_len``, target 0, to ``budget``); DMS's ramp, linear in ``CR``, is ``loss.budget_ramp: compression``
(the GPU recipe's; the CPU recipe ramps the budget linearly).

The student attention (the config's ``attention``) is ``dms_attention_fused`` (``auto`` or ``fused``, on every
device): the far keys' bias as an extra key channel through one causal sdpa call, the ``w + 1`` near keys scored by
blocks and joined as a sink key, so memory is linear in ``T`` and CUDA's fused kernels take the call (padded
widths, float32, no math fallback); exact gradients into the decisions, equal to the definition to float32
rounding. ``exact`` runs the definition, ``dms_attention``: an explicit ``[B, H, T, T]`` float mask through sdpa
(``T x T`` memory per layer; the shipped DMS adapters were trained with it). Measured cost and memory of both:
docs/training-gpu.md.

How this departs from the paper:

* decisions: the paper takes each decision from the model's own query projection (one repurposed neuron per KV
  head, no new parameters; ``spec/learned.md`` summarises it as a per-head linear adapter on the hidden state);
  here a separate linear head per layer reads the hidden state entering attention (``H_kv * (d_model + 1)``
  parameters per layer) and the projections stay whole;
* the model: DMS retrofits the whole model (all weights train, about 1K steps); ``dms`` keeps it frozen (only the
  heads train), ``dms-lora`` trains a low-rank adapter (``method.lora_rank``, ``lora_alpha``, ``lora_targets``:
  q/v projections by default) on the gated layers' attention beside the heads;
* relaxation: decisions stay relaxed (soft Gumbel-sigmoid samples, gradients through them); DMS uses hard
  straight-through decisions. A low temperature keeps the samples near 0 or 1;
* schedule and sizes: the paper ramps its compression over hundreds of steps (about 100 per unit of compression
  ratio) with a window of 256 tokens; the CPU recipes here ramp over a few dozen steps of 512-token sequences with
  ``w = 16``;
* inference (policy ``dms``): DMS evicts by the decisions alone, holding a variable number of tokens per head;
  here, for A/B comparisons at matched memory, a head also keeps at most ``budget`` tokens, ranked by the decision
  (lowest eviction logit kept first), unless the policy runs without a budget (threshold mode);
* prompt chunks: the policy evicts after each forward, so within a prompt chunk every query sees every earlier key
  of the chunk, decided "evict" or not (a prompt prefilled in one forward is read as the frozen model reads it),
  while the student applies the delayed eviction to every row, prompt rows included, as DMS's own prefill does.
  Decode steps evict as the student attends (checked token by token against the policy).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvgates.errors import AdapterError, UnsupportedModelError
from kvgates.gates.adapter import GateConfig, GateSet, gated_layers
from kvgates.gates.capture import attention_modules
from kvgates.gates.training import real_queries
from kvgates.kernels.gated import causal_visibility, fused_only, fused_width, grouped_masked_attention
from kvgates.methods.base import LearnedMethod, TrainingStep, register_method
from kvgates.policies.base import EVERY_STEP, register_policy
from kvgates.policies.learned import LearnedPolicy
from kvgates.policies.selection import recent_mask, threshold_quota
from kvgates.runtime.scoring import forward_cache, runs_policy
from kvgates.runtime.state import SlotState
from kvgates.runtime.stats import AttnStats

#: The records of a student forward: each layer's relaxed decisions ``[B, H_kv, T]``.
ALPHA = "alpha"
#: The per-slot state of the policy: each held token's eviction logit.
LOGIT = "dms_logit"
#: The PEFT adapter name of a DMS-LoRA on a model, and the adapter folder's subfolder holding its ``LoraConfig``.
ADAPTER = "kvgates-dms"
LORA_DIR = "lora"
LORA_CONFIG = "adapter_config.json"
#: The attention projections a DMS LoRA may adapt (their shapes follow from the gate config).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


# ---------------------------------------------------------------------------------------------- gates
class DecisionHead(nn.Module):
    """The eviction decisions of one layer: ``Linear(d_model -> H_kv)``, weights N(0, 0.02), bias
    ``-init_bias`` (negative: nothing is evicted at the start)."""

    def __init__(self, hidden_size: int, num_kv_heads: int, init_bias: float):
        super().__init__()
        self.proj = nn.Linear(hidden_size, num_kv_heads)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.constant_(self.proj.bias, -float(init_bias))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., d_model]`` -> eviction logits ``[..., H_kv]`` in float32 (> 0: evict)."""
        return F.linear(hidden.to(self.proj.weight.dtype), self.proj.weight, self.proj.bias).float()


class DecisionHeads(GateSet):
    """DMS decision heads, one ``DecisionHead`` per gated layer; scores are eviction logits (> 0: evict).
    ``gate_hidden`` is unused (the heads are linear) and recorded as 1."""

    kind = "dms"
    captures = "hidden"
    default_hidden = 1
    #: The heads' bias starts at -2: from -18 (TRIM-KV's retention default) the relaxed decision is saturated and
    #: nothing trains (gradient norms of 1e-10 to 1e-13, nothing evicted); -2 is the shipped recipe's
    #: (configs/train/dms.yaml), which evicts at its target within its ramp.
    default_init_bias = 2.0

    def __init__(self, config: GateConfig):
        super().__init__(config)
        self.heads = nn.ModuleList(
            DecisionHead(config.hidden_size, config.num_kv_heads, config.init_bias) for _ in config.layer_ids
        )

    def forward(self, layer_idx: int, captured: torch.Tensor) -> torch.Tensor:
        return self.heads[self.layer_position(layer_idx)](captured)


def lora_config(rank: int, alpha: float, targets: list[str] | tuple[str, ...], layers: list[int]) -> Any:
    """peft's ``LoraConfig`` of a DMS LoRA: ``targets`` of the attention of ``layers``, no dropout, no bias."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=sorted(targets), layers_to_transform=list(layers), lora_dropout=0.0, bias="none"
    )


def _config_json(config: Any) -> str:
    """A ``LoraConfig`` as peft's ``adapter_config.json``, with sets sorted (the same bytes on every save)."""
    data = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    return json.dumps(data, indent=2, sort_keys=True)


def _lora_shape(config: Any) -> tuple[int, float, tuple[str, ...], tuple[int, ...]]:
    """What makes two DMS LoRA configs the same adapter: rank, alpha, targets, layers."""
    return config.r, float(config.lora_alpha), tuple(sorted(config.target_modules)), tuple(config.layers_to_transform or ())


class DecisionHeadsLoRA(DecisionHeads):
    """DMS decision heads plus the LoRA the model adapts with (``dms-lora``).

    The gate set owns the LoRA's ``A`` / ``B`` matrices (``lora[f"{layer}-{target}"]``), so they train, checkpoint
    and ship with the heads (in ``model.safetensors``); on a model the PEFT layers that transformers' integration
    puts there (``install_lora``) run these very modules. ``lora/adapter_config.json`` holds its peft
    ``LoraConfig`` (rank, alpha, targets, layers). A fresh gate set has a rank-8 LoRA of q/v (``B = 0``: the model
    unchanged); ``configure_lora`` reshapes it before training.
    """

    kind = "dms-lora"
    parts = (f"{LORA_DIR}/*",)

    def __init__(self, config: GateConfig):
        super().__init__(config)
        default = DMSLoRAOptions()
        self.configure_lora(lora_config(default.lora_rank, default.lora_alpha, default.lora_targets, config.layer_ids))

    def _projection_shape(self, target: str) -> tuple[int, int]:
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv), "o_proj": (q, c.hidden_size)}[target]

    def configure_lora(self, config: Any) -> None:
        """Use the LoRA ``config`` (a peft ``LoraConfig``): fresh matrices, ``A`` as peft initialises it
        (Kaiming-uniform) and ``B = 0``. ``ValueError`` for targets other than the attention projections or
        layers other than the gated ones."""
        unknown = sorted(set(config.target_modules) - set(LORA_TARGETS))
        if unknown or not config.target_modules:
            raise ValueError(f"a DMS LoRA adapts attention projections ({', '.join(LORA_TARGETS)}), got {sorted(config.target_modules)}")
        if sorted(config.layers_to_transform or ()) != sorted(self.config.layer_ids):
            raise ValueError(f"a DMS LoRA adapts the gated layers {self.config.layer_ids}, got {config.layers_to_transform}")
        if config.r < 1:
            raise ValueError(f"the LoRA rank must be at least 1, got {config.r}")
        self.lora_config = config
        device = self.heads[0].proj.weight.device
        self.lora = nn.ModuleDict()
        for layer in self.config.layer_ids:
            for target in sorted(config.target_modules):
                fan_in, fan_out = self._projection_shape(target)
                a, b = nn.Linear(fan_in, config.r, bias=False), nn.Linear(config.r, fan_out, bias=False)
                nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
                nn.init.zeros_(b.weight)
                self.lora[f"{layer}-{target}"] = nn.ModuleDict({"A": a, "B": b}).to(device)

    def lora_modules(self) -> Iterator[tuple[int, str, nn.Module, nn.Module]]:
        """``(layer, target, A, B)`` of every adapted projection."""
        for key, pair in self.lora.items():
            layer, target = key.split("-", 1)
            yield int(layer), target, pair["A"], pair["B"]

    def load_parts(self, folder: Path) -> None:
        from peft import LoraConfig

        path = folder / LORA_DIR / LORA_CONFIG
        if not path.is_file():
            raise AdapterError(f"{folder} has no {LORA_DIR}/{LORA_CONFIG}; a dms-lora adapter holds its LoRA's peft config there")
        try:
            config = LoraConfig.from_pretrained(str(path.parent))
            self.configure_lora(config)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
            raise AdapterError(f"{path} is not a DMS LoRA config ({str(err).splitlines()[0]}); the file is corrupt or was edited by hand") from err

    def part_files(self, folder: Path) -> list[tuple[Path, Callable[[str], Any]]]:
        """The LoRA's peft config, ``lora/adapter_config.json``."""
        (folder / LORA_DIR).mkdir(exist_ok=True)
        text = _config_json(self.lora_config)
        return [(folder / LORA_DIR / LORA_CONFIG, lambda p: Path(p).write_text(text))]


# ---------------------------------------------------------------------------------------------- the LoRA on a model
def _tuner_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def carries_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries a DMS LoRA (``ADAPTER``) through transformers' PEFT integration."""
    return ADAPTER in (getattr(model, "peft_config", None) or {})


def install_lora(model: nn.Module, gates: DecisionHeadsLoRA) -> Callable[[], None]:
    """Run ``gates``' LoRA on ``model`` (this instance only); returns what undoes it.

    On a model without a DMS LoRA, transformers' PEFT integration adds one (``model.add_adapter``, peft's LoRA
    layers around the target projections) and its ``A`` / ``B`` are replaced by ``gates``' own modules; the undo
    deletes the adapter (``model.delete_adapter``), puts the original projections back where peft wrapped them and
    drops the flag the integration set, leaving the model as it was (``requires_grad`` included). On a model that already carries one of
    the same shape (the LoRA a DMS-LoRA run trains, during its validation), ``gates``' modules take its place and
    the undo gives the previous ones back. ``ValueError`` for one of another shape, ``UnsupportedModelError`` (one
    sentence, the model untouched) for a model whose attention lacks a target projection (``check_lora_targets``).
    """
    check_lora_targets(model, gates.lora_config.target_modules, gates.config.layer_ids)
    added = not carries_lora(model)
    if added:
        requires_grad = {p: p.requires_grad for p in model.parameters()}  # peft marks only adapters trainable
        model.add_adapter(copy.deepcopy(gates.lora_config), adapter_name=ADAPTER)
    elif _lora_shape(model.peft_config[ADAPTER]) != _lora_shape(gates.lora_config):
        raise ValueError("this model already carries a DMS LoRA of another shape; detach the policy that put it there first")
    previous = []
    for peft_layer, (_, _, a, b) in zip(lora_layers(model, gates), gates.lora_modules()):
        previous.append((peft_layer, peft_layer.lora_A[ADAPTER], peft_layer.lora_B[ADAPTER]))
        peft_layer.lora_A[ADAPTER], peft_layer.lora_B[ADAPTER] = a, b

    def undo() -> None:
        if added:
            remove_lora(model)
            for param, flag in requires_grad.items():
                param.requires_grad_(flag)
        else:
            for peft_layer, a, b in previous:
                peft_layer.lora_A[ADAPTER], peft_layer.lora_B[ADAPTER] = a, b

    return undo


def check_lora_targets(model: nn.Module, targets: Iterable[str], layers: Iterable[int]) -> None:
    """``UnsupportedModelError`` (one sentence) unless the attention of each of ``model``'s ``layers`` has every
    projection in ``targets`` that a DMS LoRA adapts (Phi-3 fuses q, k and v into one ``qkv_proj``: peft found no
    target there and stopped with its traceback, or wrapped ``o_proj`` alone before the lookup of ``k_proj`` failed).
    Reads module names only: a skeleton (meta weights) is checked before its weights load."""
    modules = attention_modules(model)
    for layer in layers:
        attention = modules[layer]
        missing = sorted(t for t in targets if not isinstance(getattr(attention, t, None), nn.Module))
        if missing:
            raise UnsupportedModelError(
                f"{type(attention).__name__} has no {', '.join(missing)} for a DMS LoRA to adapt"
                + (" (it fuses q, k and v into one qkv_proj)" if hasattr(attention, "qkv_proj") else "")
                + "; use dms gates on this model, or a dms-lora whose lora_targets are among its attention's projections"
            )


def lora_layers(model: nn.Module, gates: DecisionHeadsLoRA) -> list[nn.Module]:
    """The projections of ``model`` that ``gates``' LoRA adapts, in ``gates.lora_modules()`` order (peft's LoRA
    layers once ``install_lora`` put them there)."""
    modules = attention_modules(model)
    return [getattr(modules[layer], target) for layer, target, _, _ in gates.lora_modules()]


def switch_adapters(layers: list[nn.Module], on: bool | list[bool]) -> list[bool]:
    """Turn the PEFT ``layers`` on or off (``on``: for all, or one per layer) through peft's own flag (peft's
    ``enable_adapters`` would also set the adapters' ``requires_grad``); returns whether each was on before."""
    before = [not layer.disable_adapters for layer in layers]
    for layer, state in zip(layers, on if isinstance(on, list) else [on] * len(layers)):
        layer._disable_adapters = not state
    return before


def remove_lora(model: nn.Module) -> None:
    """Delete the DMS LoRA from ``model`` (``model.delete_adapter``), put back the original projections where peft
    left its emptied wrappers, and drop the integration's flag once no adapter is left."""
    model.delete_adapter(ADAPTER)
    for name, layer in _tuner_layers(model):
        if not any(getattr(layer, attr) for attr in layer.adapter_layer_names):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer.get_base_layer())
    if not hasattr(model, "peft_config"):
        vars(model).pop("_hf_peft_config_loaded", None)


@contextlib.contextmanager
def lora_disabled(model: nn.Module) -> Iterator[None]:
    """Run the block with the model's PEFT layers off (the frozen model), as they were again after."""
    layers = [layer for _, layer in _tuner_layers(model)]
    before = switch_adapters(layers, False)
    try:
        yield
    finally:
        switch_adapters(layers, before)


# ---------------------------------------------------------------------------------------------- training
def gumbel_sigmoid_logits(logits: torch.Tensor, temperature: float, noise: bool) -> torch.Tensor:
    """``z = (logits + g) / temperature`` with ``g`` logistic noise (``log u - log(1 - u)``) when ``noise``; the
    relaxed decision is ``sigmoid(z)``."""
    if noise:
        u = torch.rand_like(logits).clamp(1e-6, 1 - 1e-6)
        logits = logits + torch.log(u) - torch.log1p(-u)
    return logits / temperature


def delayed_bias(log_keep: torch.Tensor, window: int, attention_mask: torch.Tensor | None = None, rows: int | None = None) -> torch.Tensor:
    """``[B, H_kv, n, T]`` additive attention mask of the queries of the last ``n = rows`` (default ``T``) positions:
    causal (``-inf`` above the diagonal), plus ``log_keep[..., i]`` (``log(1 - alpha_i)``) for query ``t`` and key
    ``i`` when ``t - i > window``, plus the padding of a 4-D ``attention_mask`` (``[B, 1, n, T]``; bool: True
    attends; or additive)."""
    t = log_keep.shape[-1]
    n = t if rows is None else rows
    pos = torch.arange(t, device=log_keep.device)
    gap = pos[t - n :, None] - pos[None, :]
    causal = torch.zeros((n, t), device=log_keep.device).masked_fill(gap < 0, float("-inf"))
    bias = torch.where(gap > window, log_keep[..., None, :], 0.0) + causal
    if attention_mask is not None:
        mask = attention_mask[..., -n:, :t]
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else mask.float()
        bias = bias + mask
    return bias


def dms_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_keep: torch.Tensor,
    window: int,
    scale: float,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """DMS training attention ``[B, H, n, D]`` (``query`` ``[B, H, n, D]``, the queries of the last ``n`` of the ``T``
    positions, ``key``/``value`` ``[B, H_kv, T, D]``, ``log_keep`` ``[B, H_kv, T]``): sdpa with ``delayed_bias`` as
    its float mask, each KV head's bias shared by its query group (``grouped_masked_attention``). Memory
    ``B * H * n * T`` floats (see the module docstring)."""
    bias = delayed_bias(log_keep.float(), window, attention_mask, query.shape[2]).to(query.dtype)
    return grouped_masked_attention(query, key, value, bias, scale)


#: Query rows per block of ``dms_attention_fused``'s near part (16 was the fastest of 8-64 at w = 16 and 256 on the CPU).
NEAR_BLOCK = 16
#: The logit of a key a query may not see in ``dms_attention_fused``: finite, so that a padding row that sees
#: nothing stays finite (its softmax is uniform and its output unused), and ``exp`` of it is exactly 0 otherwise.
_HIDDEN = -1e30


def dms_attention_fused(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_keep: torch.Tensor,
    window: int,
    scale: float,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dms_attention`` in memory linear in ``T``, through sdpa's fused kernels (never the ``T x T`` mask).

    Query ``t`` sees its *near* keys ``t - w .. t`` without bias and its *far* keys ``0 .. t - w - 1`` with the
    bias ``log_keep``. The near keys are scored block by block (``NEAR_BLOCK`` queries against the
    ``NEAR_BLOCK + w`` keys around them: ``T (NEAR_BLOCK + w)`` scores per head), which gives each query's near
    output and its log-sum-exp. The far keys go through one causal sdpa call (``delayed_operands``): the bias is
    an extra key channel against a query channel of ones, and the near keys join as one *sink* key in front whose
    logit is the query's near log-sum-exp (an extra query channel) and whose value is a one-hot channel, so the
    call returns the far keys' share of the softmax over every visible key, already weighted, and the near keys'
    total weight. The output is ``far + near_weight * near_output``: the same softmax, with exact gradients into
    ``query``, ``key``, ``value`` and ``log_keep`` (through the near log-sum-exp too), in float32 (float64 stays
    float64). Same arguments and result as ``dms_attention`` (``attention_mask``: a padding mask, the only kind
    training batches carry: the keys its last row may not see are hidden from every row; a row that sees nothing
    is finite, not zero). ``query`` may hold the queries of the last ``n`` of the ``T`` positions only
    (``[B, H, n, D]``, ``attention_mask`` ``[B, 1, n, T]``; ``GateTraining``'s ``rows_from``): the far call then
    runs those rows alone (the near part, ``T (NEAR_BLOCK + w)`` scores per head, runs every row).
    """
    n, t, dv = query.shape[2], key.shape[2], value.shape[-1]
    with torch.autocast(query.device.type, enabled=False):
        work = torch.float64 if query.dtype == torch.float64 else torch.float32
        q, k, v, log_keep = (x.to(work) for x in (query, key, value, log_keep))
        if n < t:
            q = F.pad(q, (0, 0, t - n, 0))  # rows before the queries given: zeros, their outputs dropped
        real = None if attention_mask is None else real_queries(attention_mask)
        near, near_lse = _near_attention(q, k, v, min(window, t - 1), scale, real)  # a longer window sees no more
        if window + 1 >= t:  # every key is near
            return near[:, :, t - n :].to(query.dtype)
        q_far, k_far, v_far = delayed_operands(q, k, v, log_keep, window, scale, near_lse, real)
        rows = min(n, t - window)  # the far call's rows that are queries given
        q_far = q_far[:, :, q_far.shape[2] - rows :]
        with fused_only(q.device, "DMS training attention (far keys)", q_far, k_far, v_far):
            if rows == k_far.shape[2]:
                far = F.scaled_dot_product_attention(q_far, k_far, v_far, is_causal=True, scale=scale)
            else:
                visible = causal_visibility(rows, k_far.shape[2], None, q.device)
                far = F.scaled_dot_product_attention(q_far, k_far, v_far, attn_mask=visible, scale=scale)
        far = far[..., :dv] + far[..., dv : dv + 1] * near[:, :, t - rows :]
        out = torch.cat([near[:, :, t - n : window], far], 2)
    return out.to(query.dtype)


def _near_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float, real: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, T, Dv], log-sum-exp [B, H, T])`` of each query over its near keys ``t - w .. t`` alone (see
    ``dms_attention_fused``), by blocks of ``r`` queries against the ``r + w`` keys from ``w`` before the block."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    g, r = h // hkv, NEAR_BLOCK
    blocks = -(-t // r)
    tail = blocks * r - t
    keys = F.pad(k, (0, 0, window, tail)).unfold(2, r + window, r)  # [B, H_kv, blocks, D, r + w]: views
    values = F.pad(v, (0, 0, window, tail)).unfold(2, r + window, r).transpose(-1, -2)
    rows = F.pad(q, (0, 0, 0, tail)).view(b, hkv, g, blocks, r, d).transpose(2, 3).reshape(b, hkv, blocks, g * r, d)
    scores = torch.matmul(rows, keys).view(b, hkv, blocks, g, r, r + window) * scale
    row, col = torch.arange(r, device=q.device), torch.arange(r + window, device=q.device)
    pos = torch.arange(blocks, device=q.device)[:, None] * r - window + col  # [blocks, r + w] each column's key
    seen = ((pos >= 0) & (pos < t))[None]
    if real is not None:
        seen = seen & real[:, pos.clamp(0, t - 1)]  # [B, blocks, r + w]
    band = (col >= row[:, None]) & (col <= row[:, None] + window)  # row p sees columns p .. p + w
    visible = band & seen[..., None, :]  # [B or 1, blocks, r, r + w]
    scores = scores.masked_fill(~visible[:, None, :, None], _HIDDEN)
    lse = torch.logsumexp(scores, -1, keepdim=True)
    out = torch.matmul(torch.exp(scores - lse).view(b, hkv, blocks, g * r, r + window), values)
    out = out.view(b, hkv, blocks, g, r, -1).transpose(2, 3).reshape(b, h, blocks * r, -1)[:, :, :t]
    return out, lse.view(b, hkv, blocks, g, r).transpose(2, 3).reshape(b, h, blocks * r)[:, :, :t]


def delayed_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_keep: torch.Tensor,
    window: int,
    scale: float,
    near_lse: torch.Tensor,
    real: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` of ``dms_attention_fused``'s far call, square for a causal sdpa: row ``s`` is query
    ``s + w``, column 0 the sink and column ``c >= 1`` key ``c - 1``, so the causal mask shows row ``s`` the sink
    and keys ``0 .. s - 1``, the query's far keys. Channels: the model's,
    then ``[1, near_lse / scale]`` on queries against ``[log_keep / scale, 0]`` on keys (``[0, 1]`` on the sink;
    padding keys get a hidden logit instead of ``log_keep``); values carry a one-hot channel ``Dv`` on the sink
    (the near weight). All three are padded with zero channels to one width that is a multiple of 8 and the key
    and value heads repeated to the query heads, as CUDA's memory-efficient kernel (float32) takes them."""
    b, h, t, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    n = t - window  # queries with far keys (or, query w, only the sink)
    width = fused_width(max(d + 2, dv + 1))
    bias = log_keep if real is None else log_keep.masked_fill(~real[:, None], _HIDDEN)
    q_far = torch.cat([q[:, :, window:], q.new_ones(b, h, n, 1), (near_lse[:, :, window:] / scale)[..., None]], -1)
    k_far = torch.cat([k[:, :, : n - 1], (bias[:, :, : n - 1] / scale)[..., None], k.new_zeros(b, hkv, n - 1, 1)], -1)
    sink_k = k.new_zeros(b, hkv, 1, d + 2).index_fill_(-1, torch.tensor([d + 1], device=k.device), 1.0)
    sink_v = v.new_zeros(b, hkv, 1, dv + 1).index_fill_(-1, torch.tensor([dv], device=v.device), 1.0)
    q_far = F.pad(q_far, (0, width - d - 2))
    k_far = F.pad(torch.cat([sink_k, k_far], 2), (0, width - d - 2))
    v_far = F.pad(torch.cat([sink_v, F.pad(v[:, :, : n - 1], (0, 1))], 2), (0, width - dv - 1))
    return q_far, k_far.repeat_interleave(h // hkv, 1), v_far.repeat_interleave(h // hkv, 1)


#: The DMS student's attention by the training ``attention`` setting (see the module docstring).
ATTENTIONS = {"auto": dms_attention_fused, "fused": dms_attention_fused, "exact": dms_attention}


def _student_attention(name: str) -> Callable[..., torch.Tensor]:
    """``ATTENTIONS[name]``, or one sentence naming what a DMS student takes."""
    if name not in ATTENTIONS:
        raise ValueError(
            f"DMS students attend through dms_attention_fused (auto, fused) or their T x T mask (exact); "
            f"attention must be one of {', '.join(ATTENTIONS)}, got {name}"
        )
    return ATTENTIONS[name]


def eviction_hinge(alpha: torch.Tensor, budget: float, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hinge, eviction fraction)``: per row ``b``, ``frac_b`` = the mean of ``alpha`` (``[L, B, H_kv, T]``) over its
    real tokens, layers and heads, ``target_b = max(0, 1 - budget / lengths_b)``; hinge = mean over rows of
    ``max(0, target_b - frac_b)`` (one-sided: evicting more than the target costs nothing here)."""
    n_layers, _, hkv, t = alpha.shape
    real = (torch.arange(t, device=alpha.device) < lengths[:, None].to(alpha.device)).float()  # [B, T]
    frac = (alpha.float() * real[None, :, None, :]).sum((0, 2, 3)) / (n_layers * hkv * lengths.to(alpha.device).float())
    target = (1 - budget / lengths.to(alpha.device).float()).clamp(min=0)
    return (target - frac).clamp(min=0).mean(), frac.mean()


@dataclass
class DMSOptions:
    """``method:`` options of a ``dms`` run. ``window``: w, the delay (positions) before a decision takes effect
    (the policy's ``window`` must match); ``temperature``: the Gumbel-sigmoid's."""

    window: int = 16
    temperature: float = 0.5

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be greater than 0, got {self.temperature}")


@dataclass
class DMSLoRAOptions(DMSOptions):
    """``method:`` options of a ``dms-lora`` run: ``DMSOptions`` plus the LoRA's rank, alpha and target projections
    (of the gated layers' attention)."""

    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lora_rank < 1 or self.lora_alpha <= 0:
            raise ValueError(f"lora_rank must be >= 1 and lora_alpha > 0, got {self.lora_rank} and {self.lora_alpha}")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown or not self.lora_targets:
            raise ValueError(f"lora_targets must be some of {', '.join(LORA_TARGETS)}, got {self.lora_targets}")


@register_method
class DMSMethod(LearnedMethod):
    """DMS on the frozen model: decision heads only (see the module docstring). Loss
    ``(KL + CE) / 2 + loss.lambda_cap * eviction_hinge``."""

    name = "dms"
    loss_keys = frozenset({"lambda_cap", "budget_ramp_steps", "budget_ramp", "distill_chunk"})
    gate_keys = frozenset({"init_bias"})  # (linear heads: gates.hidden is not read, and noted)
    gate_set = DecisionHeads
    policies = ("dms",)
    options = DMSOptions

    def check(self, config: Any) -> None:
        super().check(config)
        window = config.policy.get("window", DMS.window)
        if window != config.method_options.window:
            raise ValueError(
                f"policy.window ({window}) must equal method.window ({config.method_options.window}): the gates learn to decide with that delay"
            )

    def check_attention(self, attention: str) -> None:
        _student_attention(attention)

    def check_context(self, gates: GateSet, context: dict[str, Any]) -> None:
        if set(context) != {"options"} or not isinstance(context["options"], DMSOptions):
            raise ValueError(f"{self.name} student forwards take options=DMSOptions(...) only, got {', '.join(context) or 'none'}")

    def partial_queries(self, context: dict[str, Any]) -> bool:
        return True  # both attentions take the queries of the last rows

    def attend(self, training, module: nn.Module, query, key, value, attention_mask, scale, captured, **kwargs) -> torch.Tensor:
        options = training.context["options"]
        logits = training.gates(module.layer_idx, captured).transpose(1, 2)  # [B, H_kv, T]
        z = gumbel_sigmoid_logits(logits, options.temperature, noise=training.gates.training)
        training.records[ALPHA][module.layer_idx] = torch.sigmoid(z)
        out = _student_attention(training.attention)(query, key, value, F.logsigmoid(-z), options.window, scale, attention_mask)
        return out.transpose(1, 2).contiguous()

    def loss(self, step: TrainingStep) -> tuple[torch.Tensor, dict[str, float]]:
        teacher = step.teacher_hidden()
        kl, ce = step.distill(step.student_hidden(options=step.config.method_options), teacher)
        hinge, frac = eviction_hinge(step.stacked(ALPHA), step.budget, step.lengths)
        loss = (kl + ce) / 2 + step.config.loss.lambda_cap * hinge
        return loss, {"kl": kl.item(), "ce": ce.item(), "hinge": hinge.item(), "evicted": frac.item(), "budget": step.budget}


@register_method
class DMSLoRAMethod(DMSMethod):
    """DMS with the model adapting: decision heads plus a LoRA (peft) of the gated layers' attention projections.
    The teacher runs with the LoRA disabled (``frozen``), the student with it."""

    name = "dms-lora"
    gate_set = DecisionHeadsLoRA
    options = DMSLoRAOptions

    def check_init(self, gates: GateSet, options: Any) -> None:
        """Refuse gates carrying a trained LoRA of another shape than ``options`` ask for (``configure_lora`` would
        drop it)."""
        config = lora_config(options.lora_rank, options.lora_alpha, options.lora_targets, gates.config.layer_ids)
        if _lora_shape(config) != _lora_shape(gates.lora_config) and any(
            bool(b.weight.detach().any()) for _, _, _, b in gates.lora_modules()
        ):
            r, alpha, targets, _ = _lora_shape(gates.lora_config)
            raise AdapterError(
                f"these gates carry a trained LoRA of rank {r}, alpha {alpha} on {', '.join(targets)}; "
                "set method.lora_rank, lora_alpha and lora_targets to match it"
            )

    def check_model(self, model: nn.Module, options: Any) -> None:
        """Refuse a model whose gated layers' attention lacks a projection of ``options.lora_targets``."""
        check_lora_targets(model, options.lora_targets, gated_layers(model))

    def setup(self, model: nn.Module, gates: GateSet, options: Any) -> None:
        """Shape the gates' LoRA by ``options`` (kept as it is when it already has that shape: ``gates.init_from``)
        and put it on ``model`` (``install_lora``) until ``teardown``."""
        self.check_init(gates, options)
        config = lora_config(options.lora_rank, options.lora_alpha, options.lora_targets, gates.config.layer_ids)
        if _lora_shape(config) != _lora_shape(gates.lora_config):
            gates.configure_lora(config)
        install_lora(model, gates)

    def teardown(self, model: nn.Module, gates: GateSet) -> None:
        if carries_lora(model):
            remove_lora(model)

    def frozen(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return lora_disabled(model)


# ---------------------------------------------------------------------------------------------- inference
@register_policy
@dataclass
class DMS(LearnedPolicy):
    """DMS eviction (Łańcucki et al. 2025) by trained decision heads (``dms`` or ``dms-lora`` gates).

    Each token's eviction logit per KV head is computed when it is written (from its layer's decision head); the
    ``window`` most recent tokens are protected; after that, a token decided "evict" (logit > 0) is dropped. With a
    ``budget`` each head also keeps at most ``budget`` tokens: the window plus the lowest eviction logits. Without
    one (threshold mode) heads hold what the decisions keep, a different number per head (ragged storage). The
    policy runs after every prompt chunk and every decode step. ``dms-lora`` gates also put their LoRA on the
    model at ``attach`` (``install_lora``: transformers' PEFT integration on that instance) and take it off at
    ``detach``; while attached it runs only in the forwards through this policy's cache (a forward pre-hook on
    the model turns it on for those and off for any other), so full-cache references computed meanwhile are the
    frozen model's.

    Departure from the paper: DMS evicts by the decisions alone; the budget cap (and the ranking by logit that
    fills it) is this project's, so that methods compare at matched memory.

    Args:
        budget: tokens per KV head at most (None: threshold mode).
        gates: a ``dms`` / ``dms-lora`` adapter; strict: require the training model.
        window: w, positions a token stays after it is written whatever its decision (match the training's).
    """

    name = "dms"
    gate_kinds = ("dms", "dms-lora")
    ragged_heads = True
    schedule = EVERY_STEP

    window: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_least(0, "window")
        if self.budget is not None:
            self._require_budget(self.window, f"the protected window ({self.window})")
        self._undo_lora: Callable[[], None] | None = None

    def attach(self, model: Any) -> DMS:
        super().attach(model)
        if isinstance(self._running, DecisionHeadsLoRA):
            try:
                undo = install_lora(model, self._running)
            except ValueError:
                self.detach()
                raise
            layers = lora_layers(model, self._running)
            before = switch_adapters(layers, False)
            hook = model.register_forward_pre_hook(functools.partial(self._switch_lora, layers), with_kwargs=True)

            def undo_all() -> None:
                hook.remove()
                switch_adapters(layers, before)
                undo()

            self._undo_lora = undo_all
        return self

    def _switch_lora(self, layers: list[nn.Module], module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before each forward of the model: the LoRA on for a forward through this policy's cache, off otherwise."""
        switch_adapters(layers, runs_policy(forward_cache(kwargs), self))

    def detach(self) -> None:
        if self._undo_lora is not None:
            self._undo_lora()
            self._undo_lora = None
        super().detach()

    def slot_state(self) -> dict[str, SlotState]:
        return {LOGIT: SlotState()}

    def observe(self, layer, stats: AttnStats) -> None:
        self.record(layer, stats, LOGIT)

    def quota(self, layer, stats: AttnStats | None) -> torch.Tensor:
        """Per sequence and head: the window and the tokens not decided "evict", at most ``budget``."""
        return threshold_quota(layer, recent_mask(layer, self.window), layer.state[LOGIT] <= 0, self.budget)

    def score(self, layer, stats: AttnStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        return -layer.state[LOGIT], recent_mask(layer, self.window)

