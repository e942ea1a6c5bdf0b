"""Tables and plots of evaluation results."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

from data.needle import digits_recalled

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _group(results: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        groups[(r["policy"], r["budget"], r["context_tokens"])].append(r)
    return groups


def recall(result: dict) -> float:
    """1 for a correct answer, else the share of passcode digits recalled in order (partial credit)."""
    return 1.0 if result["correct"] else digits_recalled(result["completion"], result["answer"])


#: How to read a cell of ``accuracy_table`` (printed with the table in the terminal and in report.md).
TABLE_LEGEND = (
    "Each cell: correct answers / needle depths · mean share of the passcode's digits recalled in order (partial "
    "credit) · KV cache memory at the end of generation (MiB)."
)


def accuracy_table(results: list[dict]) -> str:
    """Markdown table: one row per policy, one column per (context, budget): ``correct/total``, the mean share
    of passcode digits recalled (partial credit, ``data.needle.digits_recalled``) and the KV MiB held."""
    groups = _group(results)
    policies = list(dict.fromkeys(r["policy"] for r in results))
    columns = sorted({(c, b) for (_, b, c) in groups}, key=lambda cb: (cb[0], cb[1] is not None, cb[1] or 0))
    budgets = sorted({b for (_, b) in columns if b is not None})
    contexts = sorted({c for (c, _) in columns})
    header = ["policy"] + [f"{c} tok, budget {b}" for c in contexts for b in budgets]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for policy in policies:
        cells = [policy]
        for c in contexts:
            for b in budgets:
                rows = groups.get((policy, b, c)) or groups.get((policy, None, c))
                if not rows:
                    cells.append("-")
                    continue
                ok = sum(r["correct"] for r in rows)
                digits = sum(recall(r) for r in rows) / len(rows)
                mib = sum(r["kv_bytes"] for r in rows) / len(rows) / 2**20
                cells.append(f"{ok}/{len(rows)} · {digits:.0%} ({mib:.1f} MiB)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def needle_heatmap(results: list[dict], path: Path) -> Path:
    """Heatmap of ``recall`` (1 = exact, partial credit below) per policy@budget (rows) and needle depth (columns),
    one panel per context."""
    contexts = sorted({r["context_tokens"] for r in results})
    rows = len({r["label"] for r in results})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 0.32 * rows + 1.8), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        rows = [r for r in results if r["context_tokens"] == ctx]
        labels = list(dict.fromkeys(r["label"] for r in rows))
        depths = sorted({r["depth"] for r in rows})
        grid = [[0.0] * len(depths) for _ in labels]
        for r in rows:
            grid[labels.index(r["label"])][depths.index(r["depth"])] = recall(r)
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths], rotation=45)
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("needle depth")
        ax.set_title(f"{ctx} tokens: passcode digits recalled (green = exact)")
        fig.colorbar(image, ax=ax, label="share of passcode digits recalled (1 = exact answer)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
