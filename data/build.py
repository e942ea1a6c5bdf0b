"""Tokenised training / validation datasets (🤗 ``datasets``, cached on disk, deterministic from a seed).

A dataset is a *mix* of sources, each a dict with a ``task`` and a ``weight`` (default 1; the weights need not sum to
1: each row is drawn from a source with probability its weight over their sum):

* ``essays``: long-text language-modelling windows of the split's essays; the last ``completion_tokens`` tokens
  (default 64) are the completion;
* ``continuations``: the frozen model's own greedy continuation (``completion_tokens``, default 512, full cache)
  of a ``prompt_tokens`` window (default 1000) of the split's essays: the setting of long-response fidelity, where
  a budgeted cache must follow the model through its own long output (``build_dataset`` needs the ``model``);
* any task of ``data.tasks`` (``needle``, ``multikey``, ``multivalue``, ``kv``, ``variable_tracking``,
  ``passkey``, ``common_words``), built with the *train* templates for training and validation; extra keys are
  that task's options (``keys``, ``hops``, ``digits``, ...);
* ``hf``: a Hugging Face dataset (``path``, optional ``name``, ``split``) and ``text``/``jsonl``: local files
  (``path``; a ``text`` file's row is a line, or with ``sample_by: paragraph`` a paragraph between blank lines, with
  ``sample_by: document`` the whole file; rows without text are dropped, and a text of one token is passed over); rows
  give a ``text`` field (windows as for essays; ``text_field`` renames it) or ``prompt`` and ``completion`` fields.
  With ``pack: true`` the rows' texts are read as a stream (``streaming=True``, shuffled with the seed) and
  concatenated, an EOS token between documents, into rows of exactly ``seq_len`` tokens: long sequences from a corpus
  of short documents (8K-32K tokens for GPU training). Such a source's rows are divided among the splits as the essays
  are, 70/10/20 (``data.splits.SHARES``), each row by a hash of its text (``row_split``): a run trains on the train
  rows, chooses its checkpoint on the validation rows and reports on the test rows, never the same row twice (all
  three once took the whole source).

The ``essays`` windows already cross essay boundaries: they are cut from the split's essays concatenated in
file order (``data.splits``: train, validation and test by file), so rows are as long as the split allows
(about 100K training tokens with SmolLM2's tokenizer).

Each row holds ``input_ids`` and ``labels`` (the completion's token ids, ``-100`` on the prompt: losses are taken
on completion tokens only), and ``task``/``template`` for reports. ``format: chat`` wraps prompt and completion
in the tokenizer's chat template with TRL's ``apply_chat_template`` (the question goes to the user turn, the
answer prefix and answer to the assistant turn); ``raw`` keeps plain text, as the needle evaluation uses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub
from datasets.packaged_modules.json import json as json_builder
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from transformers import PreTrainedTokenizerBase

from data.splits import SHARES, SPLITS
from data.tasks import MIN_HAYSTACK, OPTIONS, TASKS, check_options, describe_options, make_example, split_ids
from kvgates.errors import ConfigError

SOURCES = ("essays", "continuations", "hf", "text", "jsonl") + TASKS + ("multikey",)
FORMATS = ("raw", "chat")
#: Keys every source accepts; the others are task options.
_COMMON = {"task", "weight"}
_SOURCE_KEYS = {
    "essays": {"completion_tokens"},
    "continuations": {"prompt_tokens", "completion_tokens"},
    "hf": {"path", "name", "split", "text_field", "completion_tokens", "pack"},
    "text": {"path", "completion_tokens", "pack", "sample_by"},
    "jsonl": {"path", "text_field", "completion_tokens", "pack"},
}
#: The completion of an ``essays`` window, a packed row or a text row when its source does not set ``completion_tokens``.
COMPLETION_TOKENS = 64
#: A ``continuations`` source's window lengths when it does not set them.
CONTINUATION_DEFAULTS = {"prompt_tokens": 1000, "completion_tokens": 512}
#: What the values of a source's own keys must be: key -> (test, the words saying what it must be).
_SOURCE_VALUES = {
    "path": (lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string"),
    "name": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "split": (lambda v: isinstance(v, str), "a string"),
    "text_field": (lambda v: isinstance(v, str), "a string"),
    "completion_tokens": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive integer"),
    "prompt_tokens": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive integer"),
    "pack": (lambda v: isinstance(v, bool), "true or false"),
    "sample_by": (lambda v: v in ("line", "paragraph", "document"), "line, paragraph or document"),
}


def check_mix(mix: list[dict[str, Any]], seq_len: int | None = None) -> None:
    """Raise ``ValueError`` (one sentence) for an empty mix, an unknown source, a bad weight (not a positive finite
    number: a ``.nan`` or ``.inf`` weight failed once the model had loaded), an unknown key, a
    value of the wrong type (``_SOURCE_VALUES``, a task's options: ``data.tasks.check_options``) or, given the rows'
    ``seq_len``, a completion that leaves no prompt in a row (a continuation's prompt and completion must fit it
    whole: a row cut to ``seq_len`` would drop the start of the prompt the model continued)."""
    if not mix:
        raise ValueError("the data mix is empty; list at least one source (e.g. {task: essays})")
    for i, source in enumerate(mix):
        if not isinstance(source, dict) or "task" not in source:
            raise ValueError(f"data source {i} must be a mapping with a 'task' key, got {source!r}")
        task = source["task"]
        if task not in SOURCES:
            raise ValueError(f"data source {i}: unknown task {task!r}; known: {', '.join(SOURCES)}")
        weight = source.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:  # (nan too)
            raise ValueError(f"data source {i} ({task}): weight must be a positive finite number, got {weight!r}")
        allowed = _COMMON | _SOURCE_KEYS.get(task, set(OPTIONS.get(task, ())))
        unknown = sorted(set(source) - allowed)
        if unknown:
            raise ValueError(f"data source {i} ({task}) has unknown keys {unknown}; allowed: {sorted(allowed)}")
        if task in OPTIONS:  # training rows take the train templates, the held-out report's the eval ones
            try:
                check_options(task, {k: v for k, v in source.items() if k not in _COMMON})
            except ValueError as err:
                raise ValueError(f"data source {i} ({task}): {err}") from None
        if task in ("hf", "text", "jsonl") and "path" not in source:
            raise ValueError(f"data source {i} ({task}) needs a 'path'")
        for key, value in source.items():
            if key in _SOURCE_VALUES and not _SOURCE_VALUES[key][0](value):
                raise ValueError(f"data source {i} ({task}): {key} must be {_SOURCE_VALUES[key][1]}, got {value!r}")
        if task in ("text", "jsonl") and not Path(source["path"]).exists():
            raise ValueError(f"data source {i} ({task}): {source['path']} does not exist")
        if task in ("text", "jsonl") and Path(source["path"]).is_dir():
            raise ValueError(f"data source {i} ({task}): {source['path']} is a folder; name a {task} file")
        if seq_len is not None and task == "continuations":
            prompt, new = (source.get(key, default) for key, default in CONTINUATION_DEFAULTS.items())
            if prompt + new > seq_len:
                raise ValueError(
                    f"data source {i} (continuations): prompt_tokens ({prompt}) + completion_tokens ({new}) must fit seq_len "
                    f"({seq_len}), or the rows would drop the start of the prompt the model continued; lower them or raise seq_len"
                )
        elif seq_len is not None and ("completion_tokens" in source or source.get("pack")):
            new = source.get("completion_tokens", COMPLETION_TOKENS)  # (the default too: a packed row had no prompt)
            if new >= seq_len:
                raise ValueError(
                    f"data source {i} ({task}): completion_tokens ({new}{'' if 'completion_tokens' in source else ' by default'}) must "
                    f"be smaller than seq_len ({seq_len}), leaving a prompt in every row"
                )


def check_readable(mix: list[dict[str, Any]]) -> None:
    """Check what a run will read from each ``hf``/``text``/``jsonl`` source of ``mix``, as far as that is cheap, so
    that a run finds a bad source before it loads the model: ``ValueError``, one sentence naming the source and its
    path (a dataset neither cached nor reachable, a folder, text that is not UTF-8, a line that is not JSON, rows
    without the text the run takes: ``text_field``, or ``prompt`` and ``completion``).

    * A local file the run reads whole (``text``/``jsonl`` without ``pack``) is loaded here as the run loads it,
      every line decoded and parsed and every row's text checked; ``datasets`` keeps the Arrow copy in its cache,
      so the run does not read the file again.
    * A streamed source (``pack: true``) and a Hub dataset (``hf``) are opened and their first row read and checked;
      a Hub dataset first by one request (``_check_hub_reachable``), so that an unreachable Hub is said at once.
      Their other rows are left to run time (a packed source is read only as far as the run's rows need, a Hub
      dataset is downloaded whole only when the run builds its data), where a bad one stops the run with one
      sentence too (``build_dataset``), but after the model has loaded.
    """
    for i, source in enumerate(mix):
        if source["task"] not in ("hf", "text", "jsonl"):
            continue
        whole = source["task"] != "hf" and not source.get("pack")
        try:
            if source["task"] == "hf":
                _check_hub_reachable(source["path"])
            elif Path(source["path"]).is_file() and Path(source["path"]).stat().st_size == 0:
                raise ValueError(f"{source['path']!r} is empty")
            rows = _external_rows(source, streaming=not whole)
            if not whole:
                try:
                    with _parser_log_held():
                        rows = datasets.Dataset.from_list(list(itertools.islice(rows, 1)))
                except Exception as err:  # datasets, pyarrow and the codecs raise many types
                    raise ValueError(f"could not read {source['path']!r} ({_reason(err)})") from None
            _check_rows(source, rows)
            if whole:  # a run takes rows of every split from it (training, validation, the closing table)
                held = set(_row_splits(source, rows))
                for split in SPLITS:
                    if split not in held:
                        raise _no_rows_in(source, len(rows), split)
        except ValueError as err:
            raise ValueError(f"data source {i} ({source['task']}): {err}") from None


def _check_hub_reachable(path: str) -> None:
    """``ValueError`` at once for a Hub dataset id when the Hub cannot be reached and ``HF_HUB_OFFLINE`` is not set:
    ``datasets`` would wait through its downloads' retries (23 s, 46 s when the dataset's card is cached) before it
    fails or falls back to its cache, which offline mode reads at once. One request, bounded by a timeout; a local
    path, an offline run and any answer of the Hub (a dataset it does not know, a gated one) are left to ``datasets``,
    which words them."""
    if datasets.config.HF_HUB_OFFLINE or Path(path).exists():
        return
    try:
        huggingface_hub.dataset_info(path, timeout=10)
    except (HFValidationError, HfHubHTTPError):
        return
    except Exception as err:  # no network, no DNS, timeout
        raise ValueError(
            f"the Hub cannot be reached for the dataset {path!r} ({type(err).__name__}) and HF_HUB_OFFLINE is not set; "
            "connect, or set HF_HUB_OFFLINE=1 to load it from the local cache"
        ) from None


def _check_rows(source: dict[str, Any], rows: datasets.Dataset) -> None:
    """``ValueError`` unless every row gives the text a run takes from ``source``: its ``text_field`` (``text``) or,
    without that column and unpacked, ``prompt`` and ``completion``."""
    if len(rows) == 0:
        raise ValueError(f"{source['path']!r} holds no rows")
    field = source.get("text_field", "text")
    names = [field] if field in rows.column_names or source.get("pack") else ["prompt", "completion"]
    for name in names:
        if name not in rows.column_names:
            wanted = f"a {field!r} field" + ("" if source.get("pack") else " or 'prompt' and 'completion'")
            raise ValueError(f"rows of {source['path']!r} need {wanted}; they have {', '.join(map(repr, rows.column_names))}")
        kind, missing = rows.features[name], rows.data.column(name).null_count
        if getattr(kind, "dtype", None) not in ("string", "large_string") or missing:
            held = f"{missing} of its {len(rows)} rows have none" if missing else f"it holds {kind}"
            raise ValueError(f"the {name!r} field of {source['path']!r} must be text in every row; {held}")


def _reason(err: BaseException) -> str:
    """``Type: message`` of ``err``, or of the error a generic ``DatasetGenerationError`` wraps (a parser's)."""
    while isinstance(err, datasets.exceptions.DatasetGenerationError) and err.__cause__ is not None:
        err = err.__cause__
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@contextlib.contextmanager
def _parser_log_held() -> Iterator[None]:
    """Hold back, while ``datasets`` reads inside the block, its JSON builder's own log line about a line it cannot
    parse ("Failed to load JSON from file ..."): the error it raises becomes our one sentence, and the line would be
    a second message on stderr saying the same. Only that builder's logger, and its level is restored afterwards."""
    logger = json_builder.logger
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _external_rows(source: dict[str, Any], streaming: bool = False) -> datasets.Dataset | datasets.IterableDataset:
    """The rows of an ``hf``/``text``/``jsonl`` source, read whole or as a stream (raises ``ValueError`` when it
    cannot be loaded)."""
    try:
        with _parser_log_held():
            if source["task"] == "hf":
                return datasets.load_dataset(source["path"], source.get("name"), split=source.get("split", "train"), streaming=streaming)
            if source["task"] == "text":
                rows = datasets.load_dataset(
                    "text", data_files=str(source["path"]), split="train", streaming=streaming, sample_by=source.get("sample_by", "line")
                )
            else:
                rows = datasets.load_dataset("json", data_files=str(source["path"]), split="train", streaming=streaming)
    except Exception as err:  # datasets raises many types (missing, offline, malformed)
        raise ValueError(f"could not load data source {source['path']!r} ({_reason(err)})") from err
    # Rows without text (a text file's blank lines, a JSON row's empty text) give no row: every one of them hashed to
    # one split, and empty rows ended the run at its closing table.
    field = source.get("text_field", "text")
    return rows.filter(lambda row: _has_text(row, field))


def _has_text(row: dict[str, Any], field: str) -> bool:
    """Whether ``row`` holds text where a run takes it: its ``field``, else its prompt and its completion (a row
    holding neither is kept, for ``_check_rows`` to say what it lacks)."""
    if field in row:
        return not isinstance(row[field], str) or bool(row[field].strip())
    if "prompt" in row or "completion" in row:
        return all(not isinstance(row.get(k), str) or bool(row[k].strip()) for k in ("prompt", "completion"))
    return True


def row_split(source: dict[str, Any], row: dict[str, Any]) -> str:
    """The split a row of an ``hf``/``text``/``jsonl`` source belongs to: a hash of its text (``text_field``, else
    ``prompt`` and ``completion``) into ``SHARES`` (70/10/20), the same on every machine and in every run, whatever
    the rows' order (a packed source is streamed shuffled). Rows of one text fall in one split."""
    field = source.get("text_field", "text")
    text = row[field] if field in row else f"{row.get('prompt')}\0{row.get('completion')}"
    share = int.from_bytes(hashlib.sha256(str(text).encode()).digest()[:8], "big") / 2**64
    for split in SPLITS:
        share -= SHARES[split]
        if share < 0:
            return split
    return SPLITS[-1]


def _row_splits(source: dict[str, Any], rows: datasets.Dataset) -> list[str]:
    """``row_split`` of every row of ``source`` (read whole), from its text columns only (a dataset's other columns,
    images or audio, are never decoded)."""
    field = source.get("text_field", "text")
    columns = [field] if field in rows.column_names else ["prompt", "completion"]
    splits = []
    for batch in rows.select_columns(columns).iter(batch_size=4096):
        splits += [row_split(source, dict(zip(columns, texts))) for texts in zip(*(batch[c] for c in columns))]
    return splits


def _no_rows_in(source: dict[str, Any], count: int, split: str) -> ValueError:
    return ValueError(
        f"none of the {count} rows of {source['path']!r} falls in the {split} split (rows are divided 70/10/20 among "
        "train, validation and test by a hash of their text); give the source more rows"
    )


def _split_rows(source: dict[str, Any], rows: datasets.Dataset, split: str) -> datasets.Dataset:
    """The rows of ``source`` (read whole) in ``split`` (``row_split``), still an Arrow dataset; ``ValueError`` when it
    has none there."""
    mine = [i for i, other in enumerate(_row_splits(source, rows)) if other == split]
    if not mine:
        raise _no_rows_in(source, len(rows), split)
    return rows.select(mine)


def _window(ids: Sequence[int], seq_len: int, completion_tokens: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """A ``seq_len`` window of ``ids`` (from a random start) split into prompt and its last ``completion_tokens``."""
    start = rng.randrange(0, max(1, len(ids) - seq_len + 1))
    window = list(ids[start : start + seq_len])
    cut = max(1, len(window) - completion_tokens)
    return window[:cut], window[cut:]


def _text_ids(tokenizer: PreTrainedTokenizerBase, source: dict[str, Any], rows: datasets.Dataset, split: str, rng: random.Random) -> list[int]:
    """The token ids of the text of a random row of ``rows`` (``source``'s in ``split``, read whole), passing over a row
    of fewer than two tokens to the next: it has no prompt and completion to split (its row had no completion token,
    and validation and the closing table stopped on it). ``ValueError`` when no row of the split has two."""
    field, start = source.get("text_field", "text"), rng.randrange(len(rows))
    for k in range(len(rows)):
        ids = tokenizer(rows[(start + k) % len(rows)][field], add_special_tokens=False)["input_ids"]
        if len(ids) >= 2:
            return ids
    raise ValueError(
        f"every row of {source['path']!r} in the {split} split is a single token; a row needs two, a prompt and a completion"
    )


class _PackedStream:
    """Consecutive ``seq_len``-token rows of a text source's documents of ``split`` (``row_split``), read as a stream
    and concatenated (an EOS token after each document); the stream starts over when it ends, unless a whole pass
    gave no text (``tokens``: what the current pass has given)."""

    def __init__(self, source: dict[str, Any], tokenizer: PreTrainedTokenizerBase, seed: int, split: str):
        self.source, self.tokenizer, self.seed, self.split = source, tokenizer, seed, split
        self.field = source.get("text_field", "text")
        self.rows = iter(())
        self.buffer: list[int] = []
        self.passes = 0
        self.tokens = 0

    def _document(self) -> list[int]:
        try:
            with _parser_log_held():
                row = next(self.rows, None)
        except Exception as err:  # a row past those check_readable reads: datasets, pyarrow and the codecs raise many types
            raise ValueError(f"could not read {self.source['path']!r} ({_reason(err)})") from None
        if row is None:
            # (not "the buffer is empty": a take may end exactly as the split's last document of a pass does)
            if self.passes > 0 and not self.tokens:
                raise ValueError(
                    f"{self.source['path']!r} holds no text in the field {self.field!r} to pack in the {self.split} split (its "
                    "documents are divided 70/10/20 among train, validation and test by a hash of their text)"
                )
            self.rows = iter(_external_rows(self.source, streaming=True).shuffle(seed=self.seed + self.passes, buffer_size=1000))
            self.passes, self.tokens = self.passes + 1, 0
            return []
        if self.field not in row:
            raise ValueError(f"rows of {self.source['path']!r} need a {self.field!r} field to be packed")
        if row_split(self.source, row) != self.split:
            return []
        ids = self.tokenizer(row[self.field], add_special_tokens=False)["input_ids"]
        self.tokens += len(ids)
        return ids + [self.tokenizer.eos_token_id] if ids else []

    def take(self, n: int) -> list[int]:
        """The next ``n`` tokens of the stream."""
        while len(self.buffer) < n:
            self.buffer.extend(self._document())
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out


def _encode(tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str, fmt: str) -> tuple[list[int], list[int]]:
    if fmt == "chat":
        from trl.data_utils import apply_chat_template

        question, _, prefix = prompt.rpartition("\nAnswer: ")
        conversation = {
            "prompt": [{"role": "user", "content": question.strip()}],
            "completion": [{"role": "assistant", "content": prefix + completion}],
        }
        texts = apply_chat_template(conversation, tokenizer)
        prompt, completion = texts["prompt"], texts["completion"]
    return (
        tokenizer(prompt, add_special_tokens=False)["input_ids"],
        tokenizer(completion, add_special_tokens=False)["input_ids"],
    )


def _continue(model_id: str, prompts: list[list[int]], new_tokens: int, batch_size: int = 8) -> list[list[int]]:
    """The greedy continuations (exactly ``new_tokens`` each, full cache) of ``prompts`` by ``model_id``'s model;
    prompts of one length run as a batch (no padding)."""
    import torch
    from tqdm import tqdm

    import kvgates

    model, tokenizer = kvgates.load_model(model_id)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    groups: list[list[int]] = []
    for i in order:
        if groups and len(groups[-1]) < batch_size and len(prompts[groups[-1][0]]) == len(prompts[i]):
            groups[-1].append(i)
        else:
            groups.append([i])
    with torch.no_grad():
        for group in tqdm(groups, desc=f"model continuations ({new_tokens} tokens)", unit="batch", dynamic_ncols=True):
            ids = torch.tensor([prompts[i] for i in group], device=model.device)
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=tokenizer.pad_token_id,
            )
            for i, row in zip(group, gen[:, ids.shape[1] :].tolist()):
                out[i] = row
    return out


def code_digest() -> str:
    """A digest of the code and files that make rows (this package's modules and the essay split): part of a built
    dataset's cache key. ``datasets`` keys its cache by the generator's arguments and the generator by its name, so
    rows built before a change to how rows are made were loaded again after it."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")) + [Path(__file__).parent / "essay_split.json"]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def file_stamps(mix: list[dict[str, Any]], model: str | None) -> tuple[tuple[str, int, int], ...]:
    """``(path, size, modification time)`` of every local file a build of ``mix`` reads: its ``hf``/``text``/``jsonl``
    sources' files (a folder's files, all of them) and, for its ``continuations``, ``model``'s where that is a local
    folder. Part of a built dataset's cache key: keyed by a source's path alone, rows made from a file were loaded
    again after the file changed (``datasets`` does the same for the files it loads). A tuple: ``from_generator`` splits
    a list-valued keyword into shards, each of them a whole build."""
    paths = [source["path"] for source in mix if source["task"] in ("hf", "text", "jsonl")]
    paths += [model] if model is not None and any(source["task"] == "continuations" for source in mix) else []
    stamps = []
    for path in map(Path, paths):
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path] if path.is_file() else []
        stamps += [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return tuple(stamps)


def _generate(tokenizer, mix_json, split, num_examples, seq_len, seed, fmt, template_set, model, code, files):
    del code, files  # (in the cache key only: ``code_digest``, ``file_stamps``)
    mix = json.loads(mix_json)
    rng = random.Random(f"mix:{split}:{seed}")
    weights = [s.get("weight", 1.0) for s in mix]
    external = {i: _external_rows(s) for i, s in enumerate(mix) if s["task"] in ("hf", "text", "jsonl") and not s.get("pack")}
    for i, rows in external.items():
        _check_rows(mix[i], rows)  # a Hub dataset's rows past the first one check_readable reads
        external[i] = _split_rows(mix[i], rows, split)
    packed = {i: _PackedStream(s, tokenizer, seed, split) for i, s in enumerate(mix) if s.get("pack")}
    built: list[dict[str, Any]] = []
    pending: dict[int, list[int]] = {}  # continuation rows by their number of new tokens
    for index in range(num_examples):
        i = rng.choices(range(len(mix)), weights)[0]
        source = mix[i]
        task = source["task"]
        options = {k: v for k, v in source.items() if k not in _COMMON}
        template = ""
        if task == "essays":
            prompt_ids, completion_ids = _window(split_ids(tokenizer, split), seq_len, options.get("completion_tokens", COMPLETION_TOKENS), rng)
        elif task == "continuations":  # the prompt now; the model continues every such row at once, below
            new = options.get("completion_tokens", CONTINUATION_DEFAULTS["completion_tokens"])
            prompt_ids, _ = _window(split_ids(tokenizer, split), options.get("prompt_tokens", CONTINUATION_DEFAULTS["prompt_tokens"]), 0, rng)
            completion_ids = [0] * new  # a placeholder of the right length
            pending.setdefault(new, []).append(index)
        elif i in packed:
            window = packed[i].take(seq_len)
            cut = seq_len - options.get("completion_tokens", COMPLETION_TOKENS)
            prompt_ids, completion_ids = window[:cut], window[cut:]
        elif i in external:
            rows, field = external[i], options.get("text_field", "text")
            if field in rows.column_names:
                ids = _text_ids(tokenizer, source, rows, split, rng)
                prompt_ids, completion_ids = _window(ids, seq_len, options.get("completion_tokens", COMPLETION_TOKENS), rng)
            else:  # then every row has a prompt and a completion (_check_rows)
                row = rows[rng.randrange(len(rows))]
                prompt_ids, completion_ids = _encode(tokenizer, row["prompt"], row["completion"], fmt)
        else:
            context = seq_len
            while True:  # a chat template's tokens, and those at the pieces' joins, are counted once encoded
                try:
                    ex = make_example(
                        task, tokenizer, split, context, seed=seed * 1_000_003 + index, template_set=template_set, fit_completion=True,
                        **options,
                    )
                except ValueError:
                    if context == seq_len:  # (its own sentence: the statements alone do not fit)
                        raise
                    raise ValueError(
                        f"{task}: a row ({'the chat template, ' if fmt == 'chat' else ''}statements, question, answer and a "
                        f"haystack of {MIN_HAYSTACK}) takes more than seq_len {seq_len} tokens; raise it or lower the task's "
                        f"options ({describe_options(options)})"
                    ) from None
                prompt_ids, completion_ids = _encode(tokenizer, ex["prompt"], ex["completion"], fmt)
                over = len(prompt_ids) + len(completion_ids) - seq_len
                if over <= 0:  # (else the cut below would take the prompt's start, where statements may sit)
                    break
                context -= over // 2 + 1  # (a haystack may re-encode longer than its tokens); make_example says when nothing fits
            template = ex["template"]
        completion_ids = completion_ids[: seq_len - 1]  # a row holds seq_len tokens at most, one of them prompt
        prompt_ids = prompt_ids[-max(1, seq_len - len(completion_ids)) :]  # the prompt gives way to the completion
        built.append({"input_ids": prompt_ids, "completion": completion_ids, "task": task, "template": template})
        if not pending:  # no row before it waits for the model: out now (datasets' progress bar counted none until the last)
            yield _labelled(built[-1])
    for new, indices in pending.items():
        continued = _continue(model, [built[i]["input_ids"] for i in indices], new)
        for i, completion_ids in zip(indices, continued):
            built[i]["completion"] = completion_ids
    for row in built[min((i for indices in pending.values() for i in indices), default=num_examples) :]:
        yield _labelled(row)


def _labelled(row: dict[str, Any]) -> dict[str, Any]:
    """A built row (prompt ``input_ids`` and ``completion``) as the dataset holds it: ``input_ids`` and ``labels``."""
    prompt_ids, completion_ids = row["input_ids"], row["completion"]
    return {"input_ids": prompt_ids + completion_ids, "labels": [-100] * len(prompt_ids) + completion_ids, "task": row["task"],
            "template": row["template"]}


def build_dataset(
    tokenizer: PreTrainedTokenizerBase,
    mix: list[dict[str, Any]],
    split: str,
    num_examples: int,
    seq_len: int,
    seed: int = 0,
    fmt: str = "raw",
    template_set: str = "train",
    cache_dir: str | None = None,
    model: str | None = None,
) -> datasets.Dataset:
    """``num_examples`` rows from ``mix`` over the ``split`` essays, each at most ``seq_len`` tokens; synthetic tasks
    use the ``template_set`` templates (``"train"``; ``"eval"`` for held-out reports). ``model`` (an id
    ``kvgates.load_model`` takes) writes the ``continuations`` rows; the mix needs it only for them.

    Built with ``datasets.Dataset.from_generator``: the result is cached on disk (under ``cache_dir``, default the
    🤗 datasets cache) keyed by every argument, by the code that makes rows (``code_digest``) and by the local files
    it reads (``file_stamps``), so a second run with the same config loads it instead of regenerating it, and a run
    after a change to that code or to those files does not. Same arguments, same rows. A source that cannot be loaded
    or gives a row without text raises ``ValueError`` (one sentence naming its path; ``check_readable`` finds most of
    these before a run loads its model).
    """
    check_mix(mix, seq_len)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.format: chat wraps rows in the tokenizer's chat template, and this model's tokenizer has none; use raw")
    if num_examples < 1 or seq_len < 64:
        raise ValueError(f"need num_examples >= 1 and seq_len >= 64, got {num_examples} and {seq_len}")
    if model is None and any(source["task"] == "continuations" for source in mix):
        raise ValueError("a 'continuations' source is written by the model: pass build_dataset a model")
    try:
        return datasets.Dataset.from_generator(
            _generate,
            gen_kwargs={
                # A list-valued keyword would be split into shards by ``from_generator``: the mix travels as JSON, the
                # files' stamps as a tuple.
                "tokenizer": tokenizer, "mix_json": json.dumps(mix, sort_keys=True), "split": split, "num_examples": num_examples,
                "seq_len": seq_len, "seed": seed, "fmt": fmt, "template_set": template_set, "model": model,
                "code": code_digest(), "files": file_stamps(mix, model),
            },
            cache_dir=cache_dir,
        )
    except datasets.exceptions.DatasetGenerationError as err:
        if isinstance(err.__cause__, ValueError):  # a source's own sentence (a row it cannot use), not datasets' wrapper
            raise err.__cause__ from None
        raise


def summarize(dataset: datasets.Dataset) -> str:
    """One line: rows, tokens, completion tokens, and the share of each task (for adapter configs and cards)."""
    tasks = dataset["task"]
    share = {t: tasks.count(t) / len(tasks) for t in sorted(set(tasks))}
    tokens = sum(len(x) for x in dataset["input_ids"])
    completion = sum(sum(1 for y in x if y != -100) for x in dataset["labels"])
    mix = ", ".join(f"{t} {s:.0%}" for t, s in share.items())
    return f"{len(tasks)} rows, {tokens} tokens ({completion} completion tokens); {mix}"
