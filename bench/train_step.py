"""Cost of one gate-training step against one teacher forward, and their peak memory.

    python bench/train_step.py --lengths 512 1024 2048 --kinds trimkv locret --budget 128

For each sequence length and gate kind, interleaving the two in every round (median of ``--repeats`` rounds):

* teacher forward: the frozen model over the sequence, plain attention, no gradient (what inference costs);
* training step: ``train.trainer.gate_loss`` (TRIM-KV: teacher forward + gated student forward + losses; Locret:
  one labelling forward + the regression) with its backward and an AdamW step on the gates.

It prints seconds, the ratio step / teacher forward, and the peak resident memory each adds to the process.
"""

from __future__ import annotations

import statistics
import time

import torch
from common import essay_ids, setup
from prefill_memory import peak_extra_bytes

from kvgates.gates import GATE_KINDS
from kvgates.gates.training import GateTraining
from train.config import TrainConfig
from train.trainer import gate_loss


def main() -> None:
    args, model, tokenizer = setup(
        __doc__, choices={"kinds": ["trimkv", "trimkv-global", "locret"]},
        lengths=[512, 1024, 2048], kinds=["trimkv", "locret"], budget=128, gate_hidden=64, completion=64, repeats=3,
    )
    model.requires_grad_(False)
    print("| kind | T | teacher forward (s) | training step (s) | step / forward | teacher peak (MiB) | step peak (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds:
        for length in args.lengths:
            config = TrainConfig.from_dict({"kind": kind, "budget": args.budget, "data": {"seq_len": length}})
            gates = GATE_KINDS[config.gate_kind].for_model(model, gate_hidden=args.gate_hidden, init_bias=8.0)
            optimizer = torch.optim.AdamW(gates.parameters(), lr=1e-4)
            ids = essay_ids(tokenizer, length, args.device)
            labels = torch.full_like(ids, -100)
            labels[:, -args.completion :] = ids[:, -args.completion :]
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
            lm_head = model.get_output_embeddings()
            with GateTraining(model, gates) as gated:

                def teacher() -> None:
                    gated.set_mode(None)
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
                        start = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - start)
                peaks = {name: peak_extra_bytes(fn) / 2**20 for name, fn in (("teacher", teacher), ("step", step))}
            t, s = statistics.median(times["teacher"]), statistics.median(times["step"])
            print(f"| {kind} | {length} | {t:.2f} | {s:.2f} | {s / t:.2f}x | {peaks['teacher']:.0f} | {peaks['step']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
