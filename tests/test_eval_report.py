"""Needle scoring and the report table (no model needed)."""

import pytest

from data.needle import digits_recalled, is_correct
from eval.report import TABLE_LEGEND, accuracy_table, needle_heatmap, recall


@pytest.mark.parametrize(
    "completion, expected",
    [(" 43936.\n", 1.0), (" 4393.\n\n", 0.8), (" 736955.", 0.0), (" 439", 0.6), (" a magical number", 0.0), ("", 0.0)],
)
def test_digits_recalled_counts_leading_matches_of_the_first_number(completion, expected):
    assert digits_recalled(completion, "43936") == pytest.approx(expected)


def _row(policy, budget, completion, answer="43936", ctx=2000, depth=0.0, kv=2**20):
    return {
        "policy": policy, "label": f"{policy}@{budget}" if budget else policy, "budget": budget,
        "context_tokens": ctx, "depth": depth, "answer": answer, "completion": completion,
        "correct": is_correct(completion, answer), "kv_bytes": kv,
    }


def test_accuracy_table_counts_exact_answers_and_partial_credit(tmp_path):
    results = [
        _row("full", None, " 43936."), _row("full", None, " 43936.", depth=1.0),
        _row("snapkv", 128, " 4393.", kv=2**19), _row("snapkv", 128, " nothing", depth=1.0, kv=2**19),
        _row("snapkv", 512, " 43936", kv=2**21), _row("snapkv", 512, " 43", depth=1.0, kv=2**21),
    ]
    assert recall(results[0]) == 1.0 and recall(results[2]) == pytest.approx(0.8)
    lines = accuracy_table(results).splitlines()
    assert lines[0] == "| policy | 2000 tok, budget 128 | 2000 tok, budget 512 |"
    assert lines[2] == "| full | 2/2 · 100% (1.0 MiB) | 2/2 · 100% (1.0 MiB) |"  # the full cache fills every budget column
    assert lines[3] == "| snapkv | 0/2 · 40% (0.5 MiB) | 1/2 · 70% (2.0 MiB) |"
    assert needle_heatmap(results, tmp_path / "h.png").stat().st_size > 0


def test_terminal_table_has_a_legend_and_the_heatmap_a_colour_bar(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from eval.config import NeedleRunConfig
    from eval.needle import write_report

    bars = []
    colorbar = Figure.colorbar
    monkeypatch.setattr(Figure, "colorbar", lambda self, *a, **k: bars.append(k.get("label")) or colorbar(self, *a, **k))
    config = NeedleRunConfig.from_yaml("configs/needle_demo.yaml", output_dir=str(tmp_path))
    text = write_report(config, [_row("full", None, " 43936."), _row("snapkv", 128, " 4393.", ctx=4000)])
    assert text.startswith(TABLE_LEGEND) and "| snapkv |" in text
    assert TABLE_LEGEND in (tmp_path / "report.md").read_text()
    assert len(bars) == 2 and all("recalled" in label for label in bars)  # one per context panel
