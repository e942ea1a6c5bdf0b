"""The A/B report: ``results.json``, ``report.md`` (headline first, then a table per task and budget with the
verdict sentences) and PNG plots (score against KV bytes held, needle heatmaps depth x length, fidelity KL along
the generated tokens)."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import matplotlib
import numpy as np

from eval.config import ABConfig, ArmSpec, ConfigError, TaskSpec
from eval.runner import JOURNAL, RECORD, ABResults
from eval.stats import LEVEL, MIN_PAIRS, Comparison
from eval.tasks import metrics_of
from kvgates.config import output_path
from kvgates.gates.adapter import atomic_write

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

MIB = 2**20
REPORT = "report.md"
SCORE_PLOT = "score_vs_kv.png"
HEADLINE_PLOT = "headline.png"


def _fmt(value: float, spec: str) -> str:
    return format(value, spec) if np.isfinite(value) else "-"


def _budget_label(budget: int | None) -> str:
    return "—" if budget is None else str(budget)


class Summary:
    """Means of every metric and of the memory held, per (task, arm, budget) and optionally per prompt length."""

    def __init__(self, rows: list[dict]):
        self.groups: dict[tuple, list[dict]] = defaultdict(list)
        for r in rows:
            self.groups[(r["task"], r["arm"], r["budget"])].append(r)
            self.groups[(r["task"], r["arm"], r["budget"], r["meta"]["context_tokens"])].append(r)

    def rows(self, task: str, arm: str, budget: int | None, length: int | None = None) -> list[dict]:
        key = (task, arm, budget) if length is None else (task, arm, budget, length)
        return self.groups.get(key, [])

    def mean(self, task: str, arm: str, budget: int | None, field: str, length: int | None = None) -> float:
        rows = self.rows(task, arm, budget, length)
        if not rows:
            return float("nan")
        values = [r[field] if field in ("kv_bytes", "state_bytes", "seconds") else r["metrics"][field] for r in rows]
        return float(np.mean(values))

    def cell(self, task: str, arm: str, budget: int | None, field: str, spec: str, length: int | None = None, scale: float = 1.0) -> str:
        """A table's cell: ``mean`` over ``scale``, formatted by ``spec``; ``-`` where the group has no result, and
        ``nan`` or ``inf`` where one of its results is not a finite number (an arm's run went wrong: it ran)."""
        if not self.rows(task, arm, budget, length):
            return "-"
        value = self.mean(task, arm, budget, field, length) / scale
        return format(value, spec) if np.isfinite(value) else str(value)


#: tab20's hues for arms, nine strong ones first and then their light shades; its greys (14, 15) are left to the
#: headline's "best heuristic" line.
ARM_COLORS = [0, 2, 4, 6, 8, 10, 12, 16, 18, 1, 3, 5, 7, 9, 11, 13, 17, 19]
#: Past ``len(ARM_COLORS)`` arms the colours come round again with the next marker and line style.
ARM_MARKERS, ARM_LINES = ["o", "s", "^", "D"], ["-", "--", ":", "-."]


def _styles(config: ABConfig) -> dict[str, dict]:
    """One colour, marker and line style per arm, the same in every plot and no two alike (the full cache is
    black)."""
    cmap, k = plt.get_cmap("tab20"), len(ARM_COLORS)
    return {
        "full": {"color": (0, 0, 0, 1), "marker": "*", "linestyle": "-"},
        **{a.label: {"color": cmap(ARM_COLORS[i % k]), "marker": ARM_MARKERS[i // k % 4], "linestyle": ARM_LINES[i // k % 4]}
           for i, a in enumerate(config.arms)},
    }


def _arm_budgets(config: ABConfig) -> list[tuple[str, int | None]]:
    return [(a.label, b) for a in config.all_arms for b in config.arm_budgets(a)]


def headline_table(config: ABConfig, summary: Summary) -> str:
    """One row per arm and budget, one column per task (its primary metric), and the mean KV MiB held."""
    header = ["arm", "budget"] + [f"{t.name}: {metrics_of(t)[0].name}" for t in config.tasks] + ["KV MiB / seq"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, budget in _arm_budgets(config):
        cells = [arm, _budget_label(budget)]
        for t in config.tasks:
            m = metrics_of(t)[0]
            cells.append(summary.cell(t.name, arm, budget, m.name, m.fmt))
        kv = [summary.mean(t.name, arm, budget, "kv_bytes") / MIB for t in config.tasks]
        cells.append(_fmt(np.mean([x for x in kv if np.isfinite(x)] or [np.nan]), ".2f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline_legend(config: ABConfig) -> str:
    """What the headline table's cells mean, for readers of the terminal as well as of report.md."""
    cells = "; ".join(
        f"{t.name}: mean {metrics_of(t)[0].name} ({'higher' if metrics_of(t)[0].higher_is_better else 'lower'} is better)"
        for t in config.tasks
    )
    return (
        f"Budget: tokens held per KV head ('—' = the full cache). Cells: {cells}. KV MiB / seq: key and value bytes "
        "each sequence really held, averaged over the tasks; '-': the task does not run at that budget; nan or inf: some "
        "result's score is not a finite number."
    )


def task_table(config: ABConfig, task: TaskSpec, budget: int, summary: Summary) -> str:
    """The full cache and every arm at ``budget`` on ``task``: each metric, per length when there are several,
    the memory held per sequence (KV and policy state) and the wall time per example (its prefill, KVzip's scoring
    forwards included, and its generation or teacher forcing, on the machine and at the time it ran)."""
    metrics = metrics_of(task)
    lengths = task.context_tokens if len(task.context_tokens) > 1 else ()
    header = ["arm", "n"] + [m.name for m in metrics] + [f"{metrics[0].name} @{n}" for n in lengths]
    header += ["KV MiB / seq", "state KiB / seq", "s / example"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm in config.all_arms:
        if arm.budgeted and budget not in config.arm_budgets(arm, task):
            continue
        b = budget if arm.budgeted else None
        rows = summary.rows(task.name, arm.label, b)
        cells = [arm.label, str(len(rows))]
        cells += [summary.cell(task.name, arm.label, b, m.name, m.fmt) for m in metrics]
        cells += [summary.cell(task.name, arm.label, b, metrics[0].name, metrics[0].fmt, n) for n in lengths]
        cells.append(summary.cell(task.name, arm.label, b, "kv_bytes", ".2f", scale=MIB))
        cells.append(summary.cell(task.name, arm.label, b, "state_bytes", ".1f", scale=1024))
        cells.append(summary.cell(task.name, arm.label, b, "seconds", ".1f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict_counts(comparisons: list[Comparison]) -> list[str]:
    """Per compared arm: how many comparisons it won, lost, and left undecided (and how many had too few pairs)."""
    tally: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for c in comparisons:
        tally[c.a][0 if c.decided and c.improvement > 0 else 1 if c.decided else 2] += 1
        tally[c.a][3] += c.n < MIN_PAIRS
        tally[c.a][4] += c.budget_b is not None
    lines = []
    for a, (won, lost, open_, few, across) in tally.items():
        line = f"{a} against its comparison arms: {won} wins, {lost} losses, {open_} without a clear difference"
        line += f" ({few} of them with fewer than {MIN_PAIRS} paired examples)" if few else ""
        line += f", over {won + lost + open_} comparisons (each task's primary metric at each budget"
        lines.append(line + (f"; {across} across budgets at matched memory)." if across else ")."))
    return lines


def best_heuristic(config: ABConfig, summary: Summary, task: TaskSpec, budget: int) -> str | None:
    """The heuristic arm with the best mean primary metric on ``task`` at ``budget`` (None before any result)."""
    m = metrics_of(task)[0]
    scored = [
        (summary.mean(task.name, a.label, budget, m.name), a.label) for a in config.arms if a.budgeted and not a.learned
    ]
    scored = [(v if m.higher_is_better else -v, label) for v, label in scored if np.isfinite(v)]
    return max(scored)[1] if scored else None


def _save(fig: plt.Figure, path: Path) -> Path:
    """Write ``fig`` to the PNG ``path`` (through a temporary file: an interrupted report keeps the plot it had) and
    close it."""
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100, bbox_inches="tight"))
    plt.close(fig)
    return path


def plot_score_vs_kv(config: ABConfig, summary: Summary, path: Path, headline: bool = False) -> Path:
    """Per task: each arm's primary metric against the KV MiB it held per sequence, one point per budget.

    ``headline``: the learned arms and the full cache against one "best heuristic" line that takes, at each budget,
    whichever heuristic scored best there (its name beside the point)."""
    n = len(config.tasks)
    cols = min(4 if headline else 3, n)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(5.2 * cols, 4 * ((n + cols - 1) // cols)), squeeze=False)
    styles = _styles(config)
    for ax, task in zip(axes.flat, config.tasks):
        m = metrics_of(task)[0]
        budgets = config.task_budgets(task)
        series = [(arm.label, [(arm.label, b) for b in config.arm_budgets(arm, task)]) for arm in config.all_arms
                  if not headline or arm.learned or not arm.budgeted]
        if headline:
            best = [(best_heuristic(config, summary, task, b), b) for b in budgets]
            series.append(("best heuristic", [(label, b) for label, b in best if label is not None]))
        for name, points in series:
            xs = [summary.mean(task.name, label, b, "kv_bytes") / MIB for label, b in points]
            ys = [summary.mean(task.name, label, b, m.name) for label, b in points]
            if name == "best heuristic":
                style = dict(color="grey", marker="o", linestyle="--")
                for (label, _), x, y in zip(points, xs, ys):
                    ax.annotate(label, (x, y), fontsize=7, color="dimgrey", xytext=(3, -9), textcoords="offset points")
            else:
                style = {**styles[name], "linestyle": "-"} if name != "full" else {**styles[name], "markersize": 14, "linestyle": "none"}
            ax.plot(xs, ys, label=name, **style)
        _kv_axis(ax)
        ax.set_xlabel("KV MiB held per sequence")
        ax.set_ylabel(f"{m.name} ({'higher' if m.higher_is_better else 'lower'} is better)")
        ax.set_title(task.name)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _kv_axis(ax) -> None:
    """A log x axis of KV MiB numbered within a decade too, where matplotlib numbers only the powers of ten (a range
    such as 2-6 MiB showed no number at all): 1, 2 and 5 times each power, every whole multiple within one decade."""
    ax.set_xscale("log")
    low, high = ax.get_xlim()
    ax.xaxis.set_major_locator(LogLocator(subs="all" if high < 10 * low else (1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_depth_heatmaps(config: ABConfig, task: TaskSpec, rows: list[dict], path: Path) -> Path:
    """One panel per arm and budget: mean recall by prompt length (rows) and depth (columns)."""
    depths = sorted({r["meta"]["depth"] for r in rows if r["task"] == task.name})
    lengths = list(task.context_tokens)
    cells: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        if r["task"] == task.name:
            cells[(r["arm"], r["budget"], r["meta"]["context_tokens"], r["meta"]["depth"])].append(r["metrics"]["recall"])
    arms = config.all_arms
    budgets = config.task_budgets(task)
    cols = len(budgets)
    fig, axes = plt.subplots(len(arms), cols, figsize=(max(6.0, 2.6 * cols + 1), 0.55 * len(lengths) * len(arms) + 1.2), squeeze=False)
    lowest = {}  # each column's lowest panel drawn, which names the depths
    for i, arm in enumerate(arms):
        for j, budget in enumerate(budgets):
            ax = axes[i, j]
            b = budget if arm.budgeted else None
            if not arm.budgeted and j:
                ax.axis("off")
                continue
            grid = [[np.mean(cells[(arm.label, b, n, d)]) if cells[(arm.label, b, n, d)] else np.nan for d in depths] for n in lengths]
            if np.isnan(grid).all():  # nothing yet (a run in progress)
                ax.axis("off")
                continue
            ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
            ax.set_xticks(range(len(depths)), [])
            ax.set_title(arm.label + (f" @{budget}" if arm.budgeted else ""), fontsize=8)
            lowest[j] = ax
    for ax in lowest.values():  # (not the last arm's row: an arm at some budgets only leaves the other columns unnamed)
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=6, rotation=90)
    fig.suptitle(f"{task.name}: recall by prompt length (tokens, rows) and depth (columns); green = exact", fontsize=9)
    fig.tight_layout()
    scale = plt.cm.ScalarMappable(norm=plt.Normalize(0, 1), cmap="RdYlGn")
    fig.colorbar(scale, ax=axes.ravel().tolist(), shrink=0.6, label="share of the answer recalled")
    return _save(fig, path)


def plot_kl_curves(config: ABConfig, task: TaskSpec, rows: list[dict], path: Path, smooth: int = 16) -> Path:
    """Per budget: each arm's KL to the full cache along the generated tokens (mean over examples, moving
    average of ``smooth`` tokens, each average drawn at the middle of its tokens)."""
    budgets = config.task_budgets(task)
    fig, axes = plt.subplots(1, len(budgets), figsize=(5.5 * len(budgets), 4), squeeze=False, sharey=True)
    styles = _styles(config)
    for ax, budget in zip(axes[0], budgets):
        for arm in config.arms:
            curves = [r["kl_curve"] for r in rows if r["task"] == task.name and r["arm"] == arm.label and r["budget"] == budget]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            mean = np.mean([c[:n] for c in curves], axis=0)
            k = max(1, min(smooth, n // 4))
            averaged = np.convolve(mean, np.ones(k) / k, mode="valid")  # [i]: the mean of tokens i .. i + k - 1,
            ax.plot(np.arange(len(averaged)) + (k - 1) / 2, averaged, label=arm.label,  # drawn at the middle of them
                    color=styles[arm.label]["color"], linestyle=styles[arm.label]["linestyle"])
        ax.set_yscale("log")
        ax.set_xlabel("generated token")
        ax.set_title(f"{task.name}, budget {budget}")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(f"KL(full || arm), moving average of up to {smooth} tokens")
    # Every arm drawn in any panel, in the config's order: an arm that runs at some budgets only (budgets: [512]) is
    # missing from the first panel.
    drawn = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels())}
    labels = [arm.label for arm in config.arms if arm.label in drawn]
    fig.legend([drawn[label] for label in labels], labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def load_config(results: dict) -> ABConfig:
    """The run's ``ABConfig`` as ``results.json`` recorded it."""
    tasks = tuple(
        TaskSpec(**{**t, **{k: tuple(t.get(k, ())) for k in ("context_tokens", "templates", "budgets")}}) for t in results["tasks"]
    )
    arms = tuple(ArmSpec(**{**a, "budgets": tuple(a.get("budgets", ()))}) for a in results["arms"] if a["label"] != "full")
    return ABConfig(
        model=results["model"], seed=results["seed"], split=results.get("split", "test"), budgets=tuple(results["budgets"]),
        arms=arms, tasks=tasks, **{k: results[k] for k in ("device", "dtype") if k in results},
    )


def placement(config: ABConfig) -> dict[str, str]:
    """The run's device and dtype where they are not the defaults (cpu, float32), which reports and records name."""
    return {k: getattr(config, k) for k in ("device", "dtype") if getattr(config, k) != getattr(ABConfig, k)}


def placement_phrase(config: ABConfig) -> str:
    """``" on cuda in bfloat16"``: the run's device and dtype where they are not the defaults, else ``""``."""
    where = placement(config)
    return (f" on {where['device']}" if "device" in where else "") + (f" in {where['dtype']}" if "dtype" in where else "")


#: How the A/B section of a model card (``arm_section``) begins.
AB_SECTION = "A/B evaluation on"


def read_record(results_dir: str | Path) -> tuple[dict, ABConfig]:
    """The ``results.json`` of the A/B run folder ``results_dir`` and the config it records; ``ValueError`` (one
    sentence naming the file) where there is none, or where it is no such record (torn by a report killed mid-write,
    another tool's file). A leading ``~`` is the home folder (``--ab=~/runs/ab``, which a shell leaves as it is)."""
    path = output_path(results_dir) / RECORD  # (where the run wrote it)
    if not path.is_file():
        raise ValueError(f"{results_dir} holds no results.json; pass the output folder of a finished python -m eval ab run")
    try:
        results = json.loads(path.read_text())
        if not isinstance(results, dict):
            raise TypeError(f"it holds a JSON {type(results).__name__}")
        missing = [key for key in ("rows", "comparisons") if key not in results]
        if missing:
            raise KeyError(missing[0])
        return results, load_config(results)
    except (ValueError, KeyError, TypeError) as err:
        why = {json.JSONDecodeError: f"not valid JSON: {err}", KeyError: f"it has no {err}"}.get(type(err), str(err))
        raise ValueError(
            f"{path} is no record of a python -m eval ab run ({why}); render it again (python -m eval ab with its config and "
            "--report-only)"
        ) from None


def arm_section(results_dir: str | Path, label: str) -> str:
    """Markdown for one arm's model card from a finished run in ``results_dir``: per task and budget the arm's
    primary metric beside the best heuristic's (named) and the full cache's, then its paired verdicts."""
    results, config = read_record(results_dir)
    if label not in {a.label for a in config.arms}:
        raise ValueError(f"{results_dir} has no arm {label!r}; its arms: {', '.join(a.label for a in config.arms)}")
    summary = Summary(results["rows"])
    for task in config.tasks:  # a card states each task's number of examples: every one of them must be in, of
        n = task.examples * len(task.context_tokens)  # every arm (the best heuristic's column, the verdicts)
        for arm, budget in [(a.label, b) for a in config.all_arms for b in (config.arm_budgets(a, task) if a.budgeted else [None])]:
            have = len(summary.rows(task.name, arm, budget))
            if have < n:
                at = f" at budget {budget}" if budget is not None else ""
                raise ValueError(
                    f"{results_dir} is not a finished run: arm {arm!r} has {have} of its {n} results on task {task.name!r}{at}; "
                    "finish it (python -m eval ab with its config) before its results go on a card"
                )
    trained = sorted({t for task in config.tasks for t in task.training_templates})
    phrasing = f"templates include training ones ({', '.join(trained)})" if trained else "templates never used in training"
    lines = [
        "| task (examples) | metric | budget | this adapter | best heuristic | full cache | KV MiB / seq (adapter) |",
        "|---|---|---|---|---|---|---|",
    ]
    for task in config.tasks:
        m = metrics_of(task)[0]
        full = summary.cell(task.name, "full", None, m.name, m.fmt)
        n = task.examples * len(task.context_tokens)
        for budget in config.task_budgets(task):
            best = best_heuristic(config, summary, task, budget)
            best_cell = f"{summary.cell(task.name, best, budget, m.name, m.fmt)} ({best})" if best else "-"
            mine = summary.cell(task.name, label, budget, m.name, m.fmt)
            kv = summary.cell(task.name, label, budget, "kv_bytes", ".2f", scale=MIB)
            lines.append(f"| {task.name} ({n}) | {m.name} | {budget} | {mine} | {best_cell} | {full} | {kv} |")
    mine = [c for c in results["comparisons"] if label in (c["a"], c["b"])]
    if any("sign_flip_p" not in c for c in mine):  # its stored sentences decided by the bootstrap interval alone
        raise ValueError(
            f"{results_dir}'s verdicts predate the sign-flip test; render them again (python -m eval ab with its config and "
            "--report-only) before they go on a card"
        )
    fields = {f.name for f in dataclasses.fields(Comparison)}
    verdicts = [f"- {Comparison(**{k: v for k, v in c.items() if k in fields}).sentence()}" for c in mine]
    heading = (
        f"{AB_SECTION} {config.model}{placement_phrase(config)} (`python -m eval ab`, run `{Path(results_dir).name}`, {config.split} essays, "
        f"{phrasing}; "
        f"budgets in tokens per KV head; {len(config.all_arms)} arms):"
    )
    return "\n".join([heading, "", *lines, "", *verdicts])


def _task_line(task: TaskSpec) -> str:
    lengths = ", ".join(str(n) for n in task.context_tokens)
    what = f"`{task.task}`, prompts of {lengths} tokens, {task.examples} examples per length"
    if task.templates:
        what += f", templates {', '.join(task.templates)}"
    if task.options:
        what += ", " + ", ".join(f"{k}={v}" for k, v in task.options.items())
    if task.budgets:
        what += f"; at budget{'s' if len(task.budgets) > 1 else ''} {', '.join(map(str, task.budgets))} only"
    return what


def _heatmap_plot(task: TaskSpec) -> str | None:
    """The file of ``task``'s depth heatmaps (tasks with an answer), or None."""
    return f"heatmap_{task.name}.png" if task.answer and task.task != "common_words" else None


def _kl_plot(task: TaskSpec) -> str | None:
    """The file of ``task``'s KL curves (fidelity tasks), or None."""
    return f"kl_{task.name}.png" if task.task == "fidelity" else None


def output_files(config: ABConfig) -> list[str]:
    """The files a run of ``config`` writes in its output folder: the journal, ``results.json``, ``report.md`` and
    every plot ``write_report`` draws (a task's own where it has results)."""
    plots = [SCORE_PLOT] + [HEADLINE_PLOT] * any(a.learned for a in config.arms)
    plots += [name for task in config.tasks for name in (_heatmap_plot(task), _kl_plot(task)) if name]
    return [JOURNAL, RECORD, REPORT, *plots]


def check_output_files(config: ABConfig) -> None:
    """``ConfigError`` when something other than a file (a folder) holds the name of a file the run writes
    (``output_files``): writing it was a traceback once every result had been computed. Run before any model work."""
    out = Path(config.output_dir)
    for name in output_files(config):
        if (out / name).exists() and not (out / name).is_file():
            raise ConfigError(f"{out / name} is a folder, where the run writes its {name}; move it away or name another output folder")


def write_report(results: ABResults, command: str = "") -> str:
    """Write ``results.json``, ``report.md`` and the plots to the run's output folder; returns the headline table
    with its legend, for the terminal.

    ``results.json`` holds the config, every row, the comparisons, ``compute_seconds`` (model time summed over the
    rows) and ``seconds`` (wall time of the invocations that computed, summed: ``ABResults.seconds``)."""
    config, rows = results.config, results.rows
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary(rows)
    minutes = results.compute_seconds / 60
    model_time = f"{minutes:.1f} min" if minutes < 60 else f"{minutes / 60:.2f} h"
    record = json.dumps(
        {
            "model": config.model, **placement(config), "seed": config.seed, "split": config.split, "budgets": list(config.budgets),
            "arms": [a.__dict__ for a in config.all_arms], "tasks": [t.__dict__ for t in config.tasks],
            "seconds": results.seconds, "compute_seconds": results.compute_seconds, "machine": results.machine,
            "comparisons": [c.to_dict() for c in results.comparisons], "rows": rows,
        },
        indent=1,
    )
    atomic_write(out / RECORD, lambda p: Path(p).write_text(record))
    headline = headline_table(config, summary)
    plots = [plot_score_vs_kv(config, summary, out / SCORE_PLOT)]
    learned = any(a.learned for a in config.arms)
    if learned:
        plots.append(plot_score_vs_kv(config, summary, out / HEADLINE_PLOT, headline=True))
    arms = f"{len(config.all_arms)} arms (the full cache and {', '.join(a.label for a in config.arms)})" if config.arms else (
        "the full cache alone (no arm to compare with it)"
    )
    md = [
        f"# A/B evaluation on {config.model}{placement_phrase(config)}",
        "",
        f"{arms} at budget{'s' if len(config.budgets) > 1 else ''} "
        f"{', '.join(map(str, config.budgets))} tokens per KV head, on {len(config.tasks)} "
        f"task{'s' if len(config.tasks) > 1 else ''} built from the {config.split} "
        f"essays (seed {config.seed}); every arm ran on exactly the same examples. Model time: {model_time} "
        f"summed over its {len(rows)} results.",
    ]
    if len(rows) < results.expected:
        md += ["", f"**In progress: {len(rows)} of {results.expected} results so far**; tables and verdicts cover the examples done."]
    if command:
        md += ["", f"Reproduce: `{command}`"]
    legend = headline_legend(config)
    md += ["", "## Headline", "", legend, "", headline, "", *verdict_counts(results.comparisons), ""]
    if learned:
        md += [f"![learned arms vs the best heuristic at each budget]({plots[1].name})", ""]
    md += [f"![score vs KV bytes, every arm]({plots[0].name})", ""]
    for task in config.tasks:
        md += [f"## {task.name}", "", _task_line(task) + ".", ""]
        for budget in config.task_budgets(task):
            md += [f"### {task.name}, budget {budget}", "", task_table(config, task, budget, summary), ""]
            md += [f"- {c.sentence()}" for c in results.comparisons if c.task == task.name and c.budget == budget]
            md.append("")
        heatmap, curves = _heatmap_plot(task), _kl_plot(task)
        if heatmap and summary.rows(task.name, "full", None):
            plots.append(plot_depth_heatmaps(config, task, rows, out / heatmap))
            md += [f"![{task.name} heatmap]({plots[-1].name})", ""]
        if curves and summary.rows(task.name, "full", None):
            plots.append(plot_kl_curves(config, task, rows, out / curves))
            md += [f"![{task.name} KL along the generated tokens]({plots[-1].name})", ""]
    md += [
        "## Notes",
        "",
        "- KV MiB / seq: key and value bytes of the slots each sequence really held at the end (budgeted layers); "
        "state KiB / seq: the per-slot policy state held beside them; s / example: wall seconds per example (prefill, "
        "KVzip's reconstruction forwards included, then generation or teacher forcing), on the machine and at the time "
        "each result was computed (reused results keep their own).",
        "- Verdicts: paired per example; percentile bootstrap 95% interval of the mean difference "
        f"({config.n_boot} resamples) and the paired sign-flip test; a verdict needs at least {MIN_PAIRS} examples, a "
        f"sign-flip p below {LEVEL} and an interval that excludes 0 (eval.stats); McNemar's exact test on exact answers. "
        "Metrics: recall = share of the answer reproduced (partial credit), exact = whole answer; "
        "kl = mean KL(full || arm) over the teacher-forced tokens, top1 = greedy agreement, first_divergence = "
        "first position the greedy choice departs; prefix = generated tokens identical to the full cache's before "
        "the first departure; nll = mean negative log-likelihood per streamed token (ppl = its exp).",
    ]
    atomic_write(out / REPORT, lambda p: Path(p).write_text("\n".join(md) + "\n"))
    return f"{legend}\n\n{headline}"
