"""Peer check of kvgates' ``kvzip`` against kvpress's ``KVzipPress`` on the embedded SmolLM2-135M: same prompts, same
budget, which tokens each keeps. NOT a test and not a dependency of kvgates: kvpress runs in its own environment.

    python3 -m venv /tmp/kvpress-venv && /tmp/kvpress-venv/bin/pip install torch==2.13.0 kvpress   # kvpress 0.5.5
    python -c "import kvgates; kvgates.load_model('smollm2-135m')"                                  # converts the model once
    python bench/kvpress_peer_check.py prompts --out outputs/peer                                # the token ids
    /tmp/kvpress-venv/bin/python bench/kvpress_peer_check.py kvpress --out outputs/peer          # kvpress's scores
    python bench/kvpress_peer_check.py compare --out outputs/peer                                # kvgates', compared

Both sides read the same token ids: the chat template's user prefix, then a window of the Paul Graham essays (the
context kvpress compresses before a question). The kvpress side runs ``KVzipPress`` on them and saves its per-layer,
per-KV-head scores (``score_val``, before it ranks them). The kvgates side computes ``kvgates.policies.kvzip.
kvzip_scores`` twice, with kvgates' own repeat prompt and with kvpress's (its first-chunk prompt and the chat
template's assistant header), and prints, at each budget, the share of the tokens kvpress's scores keep per KV head
(its top ``budget``, sinks included) that kvgates' scores keep too, and the Spearman correlation of the scores over
the context tokens. kvpress gives the chat prefix no score but its sinks; the comparison runs over the context only.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

LENGTHS = (500, 1500, 3000)  # context tokens: one reconstruction chunk, one chunk, two chunks (chunk_size 2048)
BUDGETS = (128, 256)
SINKS = 4


def model_folder() -> Path:
    """The embedded model converted to a Hugging Face folder (``kvgates.load_model`` makes it)."""
    found = sorted((Path.home() / ".cache" / "kvgates" / "models").glob("smollm2-135m-*"))
    if not found:
        sys.exit("no converted embedded model; run: python -c \"import kvgates; kvgates.load_model('smollm2-135m')\"")
    return found[-1]


def save(obj: object, path: Path) -> None:
    """``torch.save`` through a temporary file in the same folder, so that a side interrupted while it saves leaves no
    torn file for the next side to read (kvgates' ``atomic_write`` is not imported: this side may run in kvpress's
    environment)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def prompts_side(out: Path) -> None:
    """Save the prompts: the chat template's user prefix, then a window of the essays, per context length."""
    from transformers import AutoTokenizer

    from data.corpus import paul_graham_essays

    tokenizer = AutoTokenizer.from_pretrained(model_folder())
    marker = "dummy context"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
    prefix = tokenizer.encode(text.split(marker)[0], add_special_tokens=False)
    words = tokenizer.encode(paul_graham_essays(), add_special_tokens=False)
    inputs = [torch.tensor([prefix + words[:n]]) for n in LENGTHS]
    save({"prefix": len(prefix), "inputs": inputs}, out / "prompts.pt")
    print(f"{len(inputs)} prompts saved to {out / 'prompts.pt'}")


def kvpress_side(out: Path) -> None:
    from kvpress import KVzipPress
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    class Recording(KVzipPress):
        """KVzipPress that keeps a copy of its scores before ranking them."""

        recorded: list = []

        def compress_post(self, model):
            self.recorded.append(self.score_val.float().clone())
            super().compress_post(model)

    folder = model_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    saved = torch.load(out / "prompts.pt")
    prefix, inputs = saved["prefix"], saved["inputs"]
    press = Recording(compression_ratio=0.5, layerwise=True, n_sink=SINKS)
    for ids in inputs:
        with torch.no_grad(), press(model):
            model(input_ids=ids, past_key_values=DynamicCache(config=model.config))
    repeat = tokenizer.encode("\n\nRepeat the previous context exactly.", add_special_tokens=False)
    template = tokenizer.apply_chat_template([{"role": "user", "content": "x\n#"}], tokenize=False, add_generation_prompt=True)
    suffix = tokenizer.encode(template.split("x\n#")[1], add_special_tokens=False)
    save({"prefix": prefix, "inputs": inputs, "scores": Recording.recorded, "repeat_ids": repeat + suffix}, out / "kvpress.pt")
    print(f"kvpress scores of {len(inputs)} prompts saved to {out / 'kvpress.pt'}")


def kept(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """``[L, H, T]`` bool: per layer and head the ``SINKS`` first tokens and the top others, ``budget`` in all."""
    ranked = scores.clone()
    ranked[..., :SINKS] = float("inf")
    top = ranked.topk(min(budget, ranked.shape[-1]), dim=-1).indices
    return torch.zeros_like(ranked, dtype=torch.bool).scatter_(-1, top, True)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = (x.argsort(-1).argsort(-1).float() for x in (a, b))
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return float(((ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))).mean())


def compare_side(out: Path) -> None:
    import kvgates
    from kvgates.policies.kvzip import kvzip_scores

    saved = torch.load(out / "kvpress.pt")
    model, _ = kvgates.load_model("smollm2-135m")
    prefix = saved["prefix"]
    print("| context tokens | kvgates repeat prompt | budget | kvpress's kept also kept by kvgates | Spearman (context) |")
    print("|---:|---|---:|---:|---:|")
    for ids, theirs in zip(saved["inputs"], saved["scores"]):
        theirs = theirs[:, 0]  # [L, H, T]
        for label, params in (("its own", {}), ("kvpress's", {"repeat_ids": saved["repeat_ids"]})):
            ours = kvzip_scores(model, ids, **params)[:, 0]
            # Compare the context only: kvpress leaves the chat prefix unscored.
            ctx_ours, ctx_theirs = ours[..., prefix:], theirs[..., prefix:]
            rho = spearman(ctx_ours, ctx_theirs)
            for budget in BUDGETS:
                a, b = kept(ctx_ours, budget), kept(ctx_theirs, budget)
                share = float((a & b).sum() / b.sum())
                print(f"| {ids.shape[1] - prefix} | {label} | {budget} | {share:.1%} | {rho:.3f} |")


def main() -> None:
    from kvgates.cli import OneLineParser, plain
    from kvgates.config import ConfigError, check_output_folder, output_path

    parser = OneLineParser(description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    sides = {"prompts": prompts_side, "kvpress": kvpress_side, "compare": compare_side}
    parser.add_argument("side", choices=list(sides))
    parser.add_argument("--out", type=Path, default=Path("outputs/peer"))
    args = parser.parse_args()
    out = output_path(args.out)  # a leading ~ is the home folder (a shell leaves --out=~/peer as it is)
    before = list(sides)[: list(sides).index(args.side)]  # the sides this one reads after, the last one's file (SIDE.pt)
    if before and not (out / f"{before[-1]}.pt").is_file():
        parser.error(f"--out {out} holds no {before[-1]}.pt: run the {' and '.join(before)} side{'s' * (len(before) > 1)} first")
    if args.side != "compare":  # the sides that write their file there
        try:
            check_output_folder(args.out, "--out")
        except ConfigError as err:
            parser.error(str(err))
        out.mkdir(parents=True, exist_ok=True)
    sides[args.side](out)


if __name__ == "__main__":
    # The repository root instead of bench/ (whose kernels.py would shadow the `kernels` package transformers imports;
    # kvpress's environment has no kvgates but the checkout's).
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    from kvgates.cli import quiet_exits

    sys.exit(quiet_exits(main))  # Ctrl-C, a closed or full stdout: no traceback
