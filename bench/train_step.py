"""Cost of one gate-training step against one teacher forward, and their peak memory per token.

    python bench/train_step.py --model random --layers 2 --lengths 1024 4096 8192 --kinds trimkv locret --budget 256
    python bench/train_step.py --model random --layers 2 --lengths 1024 4096 --kinds dms --attention exact
    python bench/train_step.py --model random --layers 2 --lengths 4096 --kinds trimkv --eviction hard relaxed
    python bench/train_step.py --model random:llama-3.1-8b --lengths 8192 16384 --checkpoint-layers   # one GPU

For each sequence length and gate kind, interleaving the two in every round (median of ``--repeats`` rounds):

* teacher forward: the frozen model over the sequence, plain attention, no gradient (what inference costs);
* training step: ``train.trainer.gate_loss`` (TRIM-KV: teacher forward + gated student forward + losses; Locret:
  one labelling forward + the regression; DMS: teacher forward + delayed-eviction student forward + losses) with
  its backward and an AdamW step on the gates, distilling the last ``--completion`` rows (so the model's last layer
  runs on those rows only, as in a run: ``GateTraining``'s ``rows_from``).

It prints seconds, the ratio step / teacher forward, and the peak memory each adds: on CUDA the GPU's
(``torch.cuda.max_memory_allocated`` above what was allocated before), elsewhere the process's resident memory
(host high-water mark), per token of the sequence and in all. ``--attention`` picks the student's gated attention
(``kvgates.gates.training.ATTENTIONS``; ``auto``: the padded fused kernels on CUDA, the exact path elsewhere; DMS
takes ``auto`` and ``fused``, both ``dms_attention_fused`` on every device, or ``exact``, its ``T x T`` mask);
``--eviction`` picks TRIM-KV's student forward: ``soft`` (the decay), ``hard`` (``loss.hard_eviction``: the budget's
hard eviction with the soft decay's gradient) or ``relaxed`` (``loss.eviction_temperature: 1.0``, as
``configs/train/trimkv-relaxed-128.yaml``); each listed is a row of its own (other kinds train soft only).
``--checkpoint-layers`` recomputes the student's decoder layers in the backward (gradient checkpointing), as
``training.activation_checkpointing`` does in a run.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from common import essay_ids, setup, sync
from prefill_memory import peak_extra_bytes

from kvgates.cli import quiet_exits
from kvgates.gates import GATE_KINDS
from kvgates.gates.training import ATTENTIONS, GateTraining
from kvgates.methods import METHODS
from train.config import TrainConfig
from train.trainer import gate_loss

#: ``--eviction``: the ``loss`` section of each student forward TRIM-KV trains with.
EVICTION = {
    "soft": {},
    "hard": {"hard_eviction": True},
    "relaxed": {"hard_eviction": True, "eviction_temperature": 1.0},
}


def peak_bytes(run, device: str) -> int:
    """Peak memory ``run()`` adds: memory allocated on ``device`` where it is a GPU (that one, ``--device cuda:1``, not
    the current one), resident host memory elsewhere."""
    if not device.startswith("cuda"):
        return peak_extra_bytes(run)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def run_config(kind: str, eviction: str, length: int, budget: int, attention: str) -> TrainConfig:
    """The training config a row runs: ``kind`` at ``budget``, sequences of ``length``, ``eviction``'s loss section, the
    student's ``attention``."""
    return TrainConfig.from_dict(
        {"kind": kind, "budget": budget, "attention": attention, "data": {"seq_len": length}, "loss": EVICTION[eviction]}
    )


def rows(args) -> list[tuple[str, str]]:
    """``(kind, eviction)`` of each row (TRIM-KV kinds once per ``--eviction``; the others train soft only)."""
    return [(kind, eviction) for kind in args.kinds for eviction in (args.eviction if kind.startswith("trimkv") else ["soft"])]


def check(args) -> str | None:
    """What a row's config refuses (a budget that does not fit a kind or a length, an ``--attention`` a kind does not
    take), a ``--completion`` longer than a sequence, an ``--eviction`` no kind takes, or ``--attention flex`` off CUDA
    where a kind's student attends through it (``train.run.check_attention_device``'s refusal of a run), in one
    sentence before the model loads; else None."""
    if args.completion >= min(args.lengths):
        return f"--completion {args.completion} must be less than every length (--lengths {min(args.lengths)})"
    if set(args.eviction) != {"soft"} and not any(kind.startswith("trimkv") for kind in args.kinds):
        evictions, kinds = " ".join(args.eviction), " ".join(args.kinds)
        return f"--eviction {evictions} applies to the TRIM-KV kinds (trimkv, trimkv-global) only, and --kinds {kinds} has none"
    for kind, eviction in rows(args):
        for length in args.lengths:
            try:
                run_config(kind, eviction, length, args.budget, args.attention)
            except ValueError as err:
                return f"--kinds {kind}, --lengths {length}, --budget {args.budget}, --attention {args.attention}: {err}"
    gated = [kind for kind in args.kinds if METHODS[kind].reads_attention]
    if args.attention == "flex" and gated and not args.device.startswith("cuda"):
        return (
            f"--attention flex (compiled FlexAttention) has no backward on the CPU, where --kinds {' '.join(gated)} would train "
            f"(--device {args.device}); run it with --device cuda, or pick auto, exact, fused or fused-split"
        )
    return None


def main() -> None:
    args, model, tokenizer = setup(
        __doc__, choices={
            "kinds": ["trimkv", "trimkv-global", "locret", "dms"], "attention": ["auto", *ATTENTIONS],
            "eviction": list(EVICTION),
        },
        lengths=[1024, 4096, 8192], kinds=["trimkv", "locret"], budget=256, gate_hidden=64, completion=64, repeats=3,
        attention="auto", checkpoint_layers=False, eviction=["soft"], check=check,
    )
    model.requires_grad_(False)
    if args.checkpoint_layers:
        model.activation_checkpointing_enable({"use_reentrant": False})
        model.train()  # transformers checkpoints layers in training mode only (the teacher runs in eval mode)
    memory = "GPU" if args.device.startswith("cuda") else "host"
    print(
        f"| kind | T | teacher forward (s) | training step (s) | step / forward | teacher {memory} peak (MiB) "
        f"| step {memory} peak (MiB) | step {memory} peak per token (KiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind, eviction in rows(args):
        label = kind if eviction == "soft" else f"{kind} ({eviction})"
        for length in args.lengths:
            config = run_config(kind, eviction, length, args.budget, args.attention)
            gates = GATE_KINDS[config.gate_kind].for_model(model, gate_hidden=args.gate_hidden, init_bias=8.0)
            optimizer = torch.optim.AdamW(gates.parameters(), lr=1e-4)
            ids = essay_ids(tokenizer, length, args.device)
            labels = torch.full_like(ids, -100)
            labels[:, -args.completion :] = ids[:, -args.completion :]
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
            lm_head = model.get_output_embeddings()
            with GateTraining(model, gates, args.attention) as gated:

                def teacher() -> None:
                    gated.teach()
                    with torch.no_grad():
                        model(ids, use_cache=False, logits_to_keep=1)

                def step() -> None:
                    loss, _ = gate_loss(model, lm_head, gated, config, inputs, float(args.budget), 0.0)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

                teacher(), step()  # warm-up
                times = {"teacher": [], "step": []}
                for _ in range(args.repeats):
                    for name, fn in (("teacher", teacher), ("step", step)):
                        sync(args.device)
                        start = time.perf_counter()
                        fn()
                        sync(args.device)
                        times[name].append(time.perf_counter() - start)
                peaks = {name: peak_bytes(fn, args.device) for name, fn in (("teacher", teacher), ("step", step))}
            t, s = statistics.median(times["teacher"]), statistics.median(times["step"])
            print(
                f"| {label} | {length} | {t:.2f} | {s:.2f} | {s / t:.2f}x | {peaks['teacher'] / 2**20:.0f} "
                f"| {peaks['step'] / 2**20:.0f} | {peaks['step'] / 2**10 / length:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
