"""The essay split, the synthetic tasks and their template sets, and the dataset builder."""

import json
from pathlib import Path

import pytest

from data.build import build_dataset, check_mix, check_readable, summarize
from data.splits import SPLITS, essay_split, make_essay_split, split_text
from data.tasks import HAYSTACK_TASKS, TASKS, TEMPLATES, check_options, make_example, n_tokens, score, templates


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer


def test_split_is_recorded_disjoint_and_complete():
    split = essay_split()
    assert split == make_essay_split(0)  # the committed record is what the code makes
    names = [n for s in SPLITS for n in split[s]]
    assert len(names) == len(set(names))
    for s in SPLITS:
        assert split[s] and split_text(s)
    # The test split's text shares no essay with training.
    assert not set(split["train"]) & set(split["test"])


def test_a_record_listing_an_essay_in_two_splits_is_refused_naming_it(tmp_path, monkeypatch):
    """An essay listed in test and in train was refused as a record that "does not match the installed essays
    (missing: [], unknown: [])", which named nothing wrong."""
    import data.splits

    record = json.loads(data.splits.SPLIT_FILE.read_text())
    record["train"].append(record["test"][0])
    (tmp_path / "split.json").write_text(json.dumps(record))
    monkeypatch.setattr(data.splits, "SPLIT_FILE", tmp_path / "split.json")
    essay_split.cache_clear()
    try:
        with pytest.raises(ValueError, match=rf"split.json lists \['{record['test'][0]}'\] in more than one split, which would put"):
            essay_split()
    finally:
        essay_split.cache_clear()


def test_template_sets_never_share_a_template():
    for task, ts in TEMPLATES.items():
        train = {(t.statement, t.question) for t in ts if t.set == "train"}
        held = {(t.statement, t.question) for t in ts if t.set == "eval"}
        assert train and held, task
        assert not train & held, task
        assert all(t.set in ("train", "eval") for t in ts)
        assert len({t.name for t in ts}) == len(ts)
    # The demo's passcode template is held out, and no training phrasing mentions a passcode.
    assert any("passcode" in t.statement for t in templates("needle", "eval"))
    assert not any("passcode" in (t.statement + t.question + t.answer) for ts in TEMPLATES.values() for t in ts if t.set == "train")


@pytest.mark.parametrize("task", TASKS + ("multikey",))
def test_examples_are_deterministic_answerable_and_sized(tok, task):
    a = make_example(task, tok, "test", 600, seed=3, template_set="eval")
    b = make_example(task, tok, "test", 600, seed=3, template_set="eval")
    c = make_example(task, tok, "test", 600, seed=4, template_set="eval")
    assert a == b and a != c
    assert templates("needle" if task == "multikey" else task, "eval")[0].set == "eval"
    assert score(a, a["completion"]) == {"exact": 1.0, "recall": 1.0}
    assert score(a, " nothing.")["exact"] == 0.0
    assert abs(n_tokens(tok, a["prompt"]) - 600) < 120
    if task in HAYSTACK_TASKS:
        for answer in a["answers"]:
            assert answer in a["prompt"]  # the answer is findable in the context


def test_needle_depth_places_the_statement(tok):
    early = make_example("needle", tok, "test", 800, seed=1, template_set="eval", template="secret-passcode", depth=0.0)
    late = make_example("needle", tok, "test", 800, seed=1, template_set="eval", template="secret-passcode", depth=1.0)
    assert early["prompt"].index("secret passcode is") < 40
    assert late["prompt"].index("secret passcode is") > len(late["prompt"]) - 200


def test_score_partial_credit():
    ex = {"answers": ["43936"]}
    assert score(ex, " 4393.") == {"exact": 0.0, "recall": 0.8}
    assert score({"answers": ["AB", "CD"]}, "AB and EF") == {"exact": 0.0, "recall": 0.5}


def test_template_set_mismatch_and_unknowns_are_refused(tok):
    with pytest.raises(ValueError, match="eval template"):
        make_example("needle", tok, "train", 300, seed=0, template_set="train", template="secret-passcode")
    with pytest.raises(ValueError, match="unknown task 'nope'; tasks: needle, multikey, multivalue, kv, "):  # (multikey was left out)
        make_example("nope", tok, "train", 300, seed=0)
    with pytest.raises(ValueError, match="unknown task 'nope'"):  # (a KeyError)
        check_options("nope", {})
    for task in ("needle", "common_words"):  # (common_words reads no essay: it recorded any name as its split)
        with pytest.raises(ValueError, match=r"^split must be one of \('train', 'validation', 'test'\), got 'dev'$"):
            make_example(task, tok, "dev", 300, seed=0)


@pytest.mark.parametrize(
    "task, options, message",
    [
        ("multikey", {"keys": 21}, "keys 21 is more than the 20 keys the eval templates draw from"),  # rng.sample's ValueError
        ("common_words", {"top": 24}, "top \\(24\\) must be smaller than distinct \\(24\\)"),  # an IndexError
        ("common_words", {"distinct": 35}, "distinct 35 is more than the 34 words"),
        ("needle", {"hops": 2}, "needle takes no option 'hops'; its options: digits"),
        ("kv", {"pairs": "8"}, "pairs must be a positive integer, got '8'"),
    ],
)
def test_options_a_task_cannot_draw_are_one_sentence(tok, task, options, message):
    with pytest.raises(ValueError, match=message):
        make_example(task, tok, "test", 300, seed=0, template_set="eval", **options)
    make_example("multikey", tok, "test", 600, seed=0, template_set="eval", keys=20)  # every key of the eval list


def test_build_dataset_cached_deterministic_completion_only(tok, tmp_path):
    mix = [{"task": "essays", "completion_tokens": 16}, {"task": "needle"}, {"task": "kv", "pairs": 3}]
    a = build_dataset(tok, mix, "train", 6, 192, seed=1, cache_dir=str(tmp_path))
    b = build_dataset(tok, mix, "train", 6, 192, seed=1, cache_dir=str(tmp_path))
    assert len(a) == 6 and a["input_ids"] == b["input_ids"]
    for row in a:
        assert len(row["input_ids"]) == len(row["labels"]) <= 192
        first = next(i for i, y in enumerate(row["labels"]) if y != -100)
        assert all(y == -100 for y in row["labels"][:first])
        assert row["labels"][first:] == row["input_ids"][first:]
    assert summarize(a).startswith("6 rows")
    chat = build_dataset(tok, [{"task": "needle"}], "train", 1, 256, fmt="chat", cache_dir=str(tmp_path))
    assert "<|im_start|>assistant" in tok.decode(chat[0]["input_ids"])



@pytest.mark.parametrize("fmt", ["raw", "chat"])
def test_every_synthetic_row_keeps_the_statements_its_question_asks_about(tok, tmp_path, fmt):
    """Rows were made at ``seq_len`` and then cut from the left for their completion (and a chat template's tokens):
    a chat row lost its template's start, a statement at the haystack's start was cut, and with kv's 32 pairs at 512
    tokens (617 needed; now one sentence) 2 rows of 8 asked about a pair their prompt no longer held."""
    import re

    mix = [{"task": "kv", "pairs": 32}, {"task": "needle"}, {"task": "variable_tracking"}]
    rows = build_dataset(tok, mix, "train", 8, 768, seed=0, fmt=fmt, cache_dir=str(tmp_path))
    for row in rows:
        prompt = [t for t, y in zip(row["input_ids"], row["labels"]) if y == -100]
        text, completion = tok.decode(prompt), tok.decode(row["input_ids"][len(prompt) :])
        assert len(row["input_ids"]) <= 768 and text.startswith("<|im_start|>" if fmt == "chat" else text[:1])
        values = re.findall(r"\b(?:[0-9a-f]{8}|[0-9]{5}|[A-Z]{5})\b", completion)
        assert values and all(value in text for value in values), (row["task"], completion)


def test_an_example_whose_statements_do_not_fit_its_context_is_one_sentence(tok):
    """It was cut from the left in training, and in an A/B run its prompts were longer than the context stated."""
    said = r"^kv: its statements, question and a haystack of 16 take \d+ tokens, more than its 512 tokens of context; .*\(pairs=64\)$"
    with pytest.raises(ValueError, match=said):
        make_example("kv", tok, "test", 512, seed=0, template_set="eval", pairs=64)
    with pytest.raises(ValueError, match=r"^common_words: its question, answer and a list of 40 words \(4 x top\) take"):
        make_example("common_words", tok, "test", 128, seed=0, top=10, fit_completion=True)
    for task in ("kv", "common_words"):
        ex = make_example(task, tok, "test", 512, seed=0, fit_completion=True)
        assert len(tok(ex["prompt"] + ex["completion"])["input_ids"]) <= 512


def test_a_change_to_the_code_that_makes_rows_builds_them_again(tok, tmp_path, monkeypatch):
    """``datasets`` keyed the cache by the generator's arguments (the generator itself by its name): after this stop
    changed how synthetic rows fit, the quickstart trained on the rows cached before it (145 of 200 differed)."""
    import data.build as build

    mix = [{"task": "needle"}]
    assert build.code_digest() == build.code_digest()
    first = build_dataset(tok, mix, "train", 2, 192, cache_dir=str(tmp_path))
    assert build_dataset(tok, mix, "train", 2, 192, cache_dir=str(tmp_path)).cache_files == first.cache_files
    monkeypatch.setattr(build, "code_digest", lambda: "another version")
    assert build_dataset(tok, mix, "train", 2, 192, cache_dir=str(tmp_path)).cache_files != first.cache_files


def test_a_changed_local_file_builds_its_rows_again(tok, tmp_path):
    """The cache was keyed by a source's path: after the file was edited, a run trained on the rows of the old one."""
    import os

    path = tmp_path / "rows.jsonl"
    source = [{"task": "jsonl", "path": str(path)}]
    path.write_text("".join(json.dumps({"prompt": f"Old {i}?", "completion": " old."}) + "\n" for i in range(40)))
    old = build_dataset(tok, source, "train", 3, 64, cache_dir=str(tmp_path / "c"))
    assert build_dataset(tok, source, "train", 3, 64, cache_dir=str(tmp_path / "c")).cache_files == old.cache_files
    path.write_text("".join(json.dumps({"prompt": f"New {i}?", "completion": " new."}) + "\n" for i in range(40)))
    os.utime(path, ns=(0, 0))  # (the same size as before: the change is told by its time)
    new = build_dataset(tok, source, "train", 3, 64, cache_dir=str(tmp_path / "c"))
    assert all(tok.decode(ids).startswith("New") for ids in new["input_ids"])


def test_a_mix_of_several_local_files_builds_the_rows_asked_for(tok, tmp_path):
    """The local files' stamps went into the cache key as a list, which ``datasets.Dataset.from_generator`` splits
    into shards, each of them a whole build: a mix of two files (or a folder of two) built twice the rows asked for."""
    for name in ("a", "b"):
        rows = "".join(json.dumps({"prompt": f"{name} {i}?", "completion": " yes."}) + "\n" for i in range(40))
        (tmp_path / f"{name}.jsonl").write_text(rows)
    mix = [{"task": "jsonl", "path": str(tmp_path / name)} for name in ("a.jsonl", "b.jsonl")]
    assert len(build_dataset(tok, mix, "train", 5, 64, cache_dir=str(tmp_path / "c"))) == 5


def test_rows_go_out_as_they_are_made(tok, monkeypatch):
    """The generator made every row before it gave out the first: ``datasets``' progress bar counted no row through a
    long build (minutes of packed 16K-token rows), then all of them. A row now goes out once made, unless a row before
    it waits for the model (``continuations``, continued together at the end)."""
    import data.build as build

    made = []
    make = build.make_example
    monkeypatch.setattr(build, "make_example", lambda *args, **kwargs: made.append(args[0]) or make(*args, **kwargs))
    rows = build._generate(tok, json.dumps([{"task": "needle"}]), "train", 5, 192, 0, "raw", "train", None, "", ())
    assert next(rows)["task"] == "needle" and len(made) == 1
    assert len(list(rows)) == 4 and len(made) == 5


def test_continuations_are_the_models_own_greedy_output(tok, tmp_path):
    import torch
    from helpers import tiny_model

    from data.tasks import split_ids

    ref, _ = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=256)
    ref.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    mix = [{"task": "continuations", "prompt_tokens": 40, "completion_tokens": 6}, {"task": "essays", "completion_tokens": 8}]
    rows = build_dataset(tok, mix, "train", 6, 64, seed=2, cache_dir=str(tmp_path / "c"), model=str(tmp_path / "m"))
    continued = [r for r in rows if r["task"] == "continuations"]
    assert len(rows) == 6 and continued and len(continued) < len(rows)  # (the model folder's files made a build each)
    essays = list(split_ids(tok, "train"))
    for row in continued:
        prompt = [t for t, y in zip(row["input_ids"], row["labels"]) if y == -100]
        completion = row["input_ids"][len(prompt) :]
        assert len(prompt) == 40 and row["labels"][len(prompt) :] == completion and len(completion) == 6
        assert any(essays[i : i + 40] == prompt for i in range(len(essays)))  # a window of the split's essays
        with torch.no_grad():
            ids = torch.tensor([prompt])
            greedy = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert completion == greedy[0, 40:].tolist()
    with pytest.raises(ValueError, match="pass build_dataset a model"):
        build_dataset(tok, mix, "train", 6, 64, cache_dir=str(tmp_path / "c"))


@pytest.mark.parametrize(
    "mix, message",
    [
        ([], "empty"),
        ([{"task": "novel"}], "unknown task"),
        ([{"task": "needle", "weight": 0}], "weight"),
        ([{"task": "needle", "weight": float("nan")}], "weight must be a positive finite number, got nan"),  # failed when built
        ([{"task": "needle", "weight": float("inf")}], "weight must be a positive finite number, got inf"),
        ([{"task": "needle", "weight": True}], "weight must be a positive finite number, got True"),
        ([{"task": "needle", "colour": 1}], "unknown keys"),
        ([{"task": "jsonl", "path": "/nonexistent.jsonl"}], "does not exist"),
        ([{"task": "jsonl", "path": "data"}], "data source 0 \\(jsonl\\): data is a folder; name a jsonl file"),  # 'Unable to find'
        ([{"task": "hf"}], "needs a 'path'"),
        ([{"task": "continuations", "keys": 3}], "unknown keys"),
        ([{"task": "jsonl", "path": 5}], "data source 0 \\(jsonl\\): path must be a non-empty string, got 5"),  # a TypeError
        ([{"task": "hf", "path": ""}], "path must be a non-empty string, got ''"),  # datasets' IndexError, as a reason
        ([{"task": "essays", "completion_tokens": "abc"}], "completion_tokens must be a positive integer, got 'abc'"),
        ([{"task": "essays", "completion_tokens": 0}], "completion_tokens must be a positive integer, got 0"),
        ([{"task": "continuations", "prompt_tokens": 1.5}], "prompt_tokens must be a positive integer, got 1.5"),
        ([{"task": "hf", "path": "x/y", "text_field": 3}], "text_field must be a string, got 3"),
        ([{"task": "needle", "hops": 3}], "unknown keys \\['hops'\\]"),  # another task's option: ignored before
        ([{"task": "kv", "pairs": 0}], "data source 0 \\(kv\\): pairs must be a positive integer, got 0"),
        ([{"task": "multikey", "keys": 25}], "keys 25 is more than the 20 keys the train and eval templates draw from"),
        ([{"task": "common_words", "distinct": 40}], "distinct 40 is more than the 34 words"),
        ([{"task": "common_words", "top": 5, "distinct": 5}], "top \\(5\\) must be smaller than distinct \\(5\\)"),
        ([{"task": "text", "path": __file__, "pack": True, "completion_tokens": 64}], "completion_tokens \\(64\\) must be smaller than seq_len"),
        # (the default: a packed row of 63 tokens, none of them prompt)
        ([{"task": "jsonl", "path": __file__, "pack": True}], "completion_tokens \\(64 by default\\) must be smaller than seq_len \\(64\\)"),
        ([{"task": "continuations", "prompt_tokens": 40}], "prompt_tokens \\(40\\) \\+ completion_tokens \\(512\\) must fit seq_len \\(64\\)"),
    ],
)
def test_bad_mixes_fail_with_one_sentence(mix, message):
    with pytest.raises(ValueError, match=message):
        check_mix(mix, seq_len=64)


def test_local_jsonl_source(tok, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "Say hi.", "completion": " Hi."}\n')
    ds = build_dataset(tok, [{"task": "jsonl", "path": str(path)}], "train", 2, 64, cache_dir=str(tmp_path / "c"))
    assert tok.decode(ds[0]["input_ids"]) == "Say hi. Hi."


def test_rows_without_text_are_dropped_and_long_completions_cut_to_seq_len(tok, tmp_path):
    """A text file's blank lines were rows (all hashed to one split: a run trained, then crashed at its closing table
    on empty test rows); a completion longer than seq_len made rows of 371-399 tokens at seq_len 96. A text file's
    row is a line, or a paragraph with sample_by: paragraph."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"Paragraph {i} starts here,\nand goes on a little.\n\n\n" for i in range(40)))
    for sample_by, whole in (("line", False), ("paragraph", True)):
        source = {"task": "text", "path": str(text), "sample_by": sample_by}
        check_readable([source])
        for split in ("train", "test"):
            ds = build_dataset(tok, [source], split, 6, 64, cache_dir=str(tmp_path / "c"))
            assert all(len(row["input_ids"]) > 1 and any(label != -100 for label in row["labels"]) for row in ds)
            assert all(("starts here" in t and "goes on" in t) == whole for t in map(tok.decode, ds["input_ids"]))
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"prompt": f"Q{i}?", "completion": " word" * 300}) + "\n" for i in range(20)))
    ds = build_dataset(tok, [{"task": "jsonl", "path": str(long)}], "train", 4, 96, cache_dir=str(tmp_path / "c"))
    assert all(len(row["input_ids"]) == 96 and row["labels"][0] == -100 for row in ds)
    with pytest.raises(ValueError, match="sample_by must be line, paragraph or document, got 'word'"):
        check_mix([{"task": "text", "path": str(text), "sample_by": "word"}], seq_len=64)
    # A line of one token was a row without a completion token: validation and the closing table stopped on it.
    words = tmp_path / "words.txt"
    words.write_text("".join(f"word\nline {i} of several tokens\n" for i in range(40)))
    for split in ("train", "test"):
        ds = build_dataset(tok, [{"task": "text", "path": str(words)}], split, 8, 64, cache_dir=str(tmp_path / "c"))
        assert all(row["labels"][0] == -100 and row["labels"][-1] != -100 for row in ds)
    (tmp_path / "one.txt").write_text("word\nhello\n" * 20)
    with pytest.raises(ValueError, match=r"^every row of '.*one.txt' in the train split is a single token; a row needs two"):
        build_dataset(tok, [{"task": "text", "path": str(tmp_path / "one.txt")}], "train", 2, 64, cache_dir=str(tmp_path / "c"))


def test_an_external_sources_rows_are_divided_among_the_splits(tok, tmp_path):
    """Validation and the held-out table took their rows from the whole source, training's too: a run chose its
    checkpoint on, and reported, rows it trained on, under a heading saying they were held out. Each row now belongs
    to one split, by a hash of its text (70/10/20, as the essays)."""
    from data.build import row_split

    pairs = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(40)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    source = {"task": "jsonl", "path": str(path)}
    texts = {}
    for split in ("train", "validation", "test"):
        ds = build_dataset(tok, [source], split, 12, 64, cache_dir=str(tmp_path / "c"))
        texts[split] = {tok.decode(row["input_ids"]) for row in ds}
        expected = {p["prompt"] + p["completion"] for p in pairs if row_split(source, p) == split}
        assert texts[split] <= expected, split
    assert not (texts["train"] & texts["validation"]) and not (texts["train"] & texts["test"]) and texts["validation"]
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(pairs[0]) + "\n")  # a train row: the other splits have none
    assert row_split(source, pairs[0]) == "train"
    with pytest.raises(ValueError, match=r"none of the 1 rows of .*one.jsonl' falls in the validation split"):
        build_dataset(tok, [{"task": "jsonl", "path": str(one)}], "validation", 2, 64, cache_dir=str(tmp_path / "c"))
    # ... which a run is told before its model loads (a file it reads whole; a Hub dataset's rows are read later)
    with pytest.raises(ValueError, match=r"data source 0 \(jsonl\): none of the 1 rows of .*one.jsonl' falls in the validation split"):
        check_readable([{"task": "jsonl", "path": str(one)}])
    check_readable([source])


def test_packed_source_streams_documents_into_rows_of_exactly_seq_len(tok, tmp_path):
    import json

    docs = [f"Document {i} says {'word ' * (3 + i % 5)}." for i in range(40)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    ds = build_dataset(tok, [{"task": "jsonl", "path": str(path), "pack": True, "completion_tokens": 16}], "train", 6, 64,
                       cache_dir=str(tmp_path / "c"))
    longest = max(n_tokens(tok, d) for d in docs)
    assert longest < 64
    for row in ds:
        assert len(row["input_ids"]) == 64  # several documents per row
        assert row["input_ids"].count(tok.eos_token_id) >= 2
        assert row["labels"][:48] == [-100] * 48 and row["labels"][48:] == row["input_ids"][48:]
    text = "".join(tok.decode(row["input_ids"]) for row in ds)
    pieces = [piece for piece in text.split(tok.eos_token) if piece]
    assert set(pieces[1:-1]) <= set(docs)  # whole documents, in the stream's order, across row boundaries
    from data.build import row_split

    source = {"task": "jsonl", "path": str(path)}
    assert {row_split(source, {"text": piece}) for piece in pieces[1:-1]} == {"train"}  # the train split's documents only
    with pytest.raises(ValueError, match="pack must be true or false"):
        check_mix([{"task": "jsonl", "path": str(path), "pack": "yes"}])


def test_a_file_read_whole_is_checked_to_its_last_row_and_a_stream_at_its_first(tmp_path):
    """``check_readable`` reads an unpacked local file as the run will, all of it: a bad line past the first 10 MB
    (what a stream's first read covers, so it once passed the check and failed after the model loaded) and rows
    without text are one sentence naming the file. A packed source is read at run time only as far as its rows need:
    the check reads its first row."""
    import json

    good = json.dumps({"text": "a line of text " * 20}) + "\n"
    late = tmp_path / "late.jsonl"
    late.write_text(good * ((11 << 20) // len(good)) + "not json\n")
    with pytest.raises(ValueError, match=f"data source 0 \\(jsonl\\): could not load data source '{late}' \\(ArrowInvalid: JSON parse error"):
        check_readable([{"task": "jsonl", "path": str(late)}])
    check_readable([{"task": "jsonl", "path": str(late), "pack": True}])
    (tmp_path / "late.txt").write_bytes(b"text\n" * ((11 << 20) // 5) + b"\xff\xfe\n")
    with pytest.raises(ValueError, match="data source 1 \\(text\\): could not load data source .*late.txt' \\(UnicodeDecodeError"):
        check_readable([{"task": "essays"}, {"task": "text", "path": str(tmp_path / "late.txt")}])

    cases = {
        "fieldless.jsonl": ('{"body": "x"}\n', "rows of '{}' need a 'text' field or 'prompt' and 'completion'; they have 'body'"),
        "gap.jsonl": ('{"text": "x"}\n{"title": "y"}\n', "the 'text' field of '{}' must be text in every row; 1 of its 2 rows have none"),
        "numbers.jsonl": ('{"text": 1}\n', "the 'text' field of '{}' must be text in every row; it holds Value\\('int64'\\)"),
        "empty.jsonl": ("", "'{}' is empty"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message.format(tmp_path / name)):
            check_readable([{"task": "jsonl", "path": str(tmp_path / name)}])
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}.", "completion": f" {i}."}) + "\n" for i in range(40)))
    check_readable([{"task": "jsonl", "path": str(tmp_path / "pairs.jsonl")}])
    with pytest.raises(ValueError, match="rows of '.*pairs.jsonl' need a 'text' field; they have 'prompt', 'completion'"):
        check_readable([{"task": "jsonl", "path": str(tmp_path / "pairs.jsonl"), "pack": True}])  # packing takes text only


def test_a_hub_dataset_row_without_text_is_one_sentence_when_the_data_is_built(tok, tmp_path):
    """A ``datasets`` source is checked at its first row before a run; its other rows when the data is built, where a
    row without text is the same sentence naming the source (it was a tokenizer error inside datasets' wrapper)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "a document"}\n{"title": "no text"}\n')
    source = {"task": "hf", "path": str(folder)}
    check_readable([source])
    with pytest.raises(ValueError, match=f"^the 'text' field of '{folder}' must be text in every row; 1 of its 2 rows have none$"):
        build_dataset(tok, [source], "train", 2, 64, cache_dir=str(tmp_path / "c"))


def test_an_unreachable_hub_is_said_at_once_without_offline_mode(tmp_path, monkeypatch):
    """With the network down and ``HF_HUB_OFFLINE`` unset, a Hub dataset's check waited through datasets' download
    retries (23 s) for its failure: one bounded request now says so at once, with what to do. Offline, and for a
    local folder, nothing is asked of the Hub."""
    import datasets
    import huggingface_hub

    def unreachable(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "dataset_info", unreachable)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("datasets was asked"))
    message = ("data source 0 (hf): the Hub cannot be reached for the dataset 'team/corpus' (ConnectionError) and HF_HUB_OFFLINE "
               "is not set; connect, or set HF_HUB_OFFLINE=1 to load it from the local cache")
    with pytest.raises(ValueError, match=f"^{message}$".replace("(", "\\(").replace(")", "\\)")):
        check_readable([{"task": "hf", "path": "team/corpus"}])

    monkeypatch.undo()
    monkeypatch.setattr(huggingface_hub, "dataset_info", lambda *a, **k: pytest.fail("the Hub was asked"))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "train.jsonl").write_text('{"text": "a document"}\n')
    check_readable([{"task": "hf", "path": str(tmp_path / "corpus")}])
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="could not load data source 'team/corpus' .*OfflineModeIsEnabled"):
        check_readable([{"task": "hf", "path": "team/corpus"}])


def test_essay_rows_can_be_longer_than_any_essay(tok, tmp_path):
    from data.corpus import essays_dir

    longest = max(n_tokens(tok, (essays_dir() / name).read_text()) for name in essay_split()["train"])
    ds = build_dataset(tok, [{"task": "essays"}], "train", 2, 2 * longest, cache_dir=str(tmp_path / "c"))
    assert all(len(row["input_ids"]) == 2 * longest for row in ds)


def test_a_malformed_json_line_is_our_one_sentence_without_datasets_own_log_line(tmp_path, caplog, capfd):
    """``datasets``' JSON builder logs "Failed to load JSON from file ..." on stderr before it raises; the run's one
    sentence said the same again, so a user read two messages. Its logger is held back while we read (the file whole,
    and a packed stream's rows) and its level restored afterwards."""
    import logging

    from datasets.packaged_modules.json import json as json_builder

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a document"}\n{not json\n')
    level = json_builder.logger.level
    caplog.set_level(logging.WARNING)
    for source in ({"task": "jsonl", "path": str(bad)}, {"task": "jsonl", "path": str(bad), "pack": True}):
        message = f"^data source 0 \\(jsonl\\): could not (load data source|read) '{bad}' \\(ArrowInvalid: JSON parse error"
        with pytest.raises(ValueError, match=message):
            check_readable([source])
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("datasets")]
    assert "Failed to load JSON" not in capfd.readouterr().err
    assert json_builder.logger.level == level


def test_data_splits_help_says_what_it_does_and_writes_nothing(monkeypatch, tmp_path, capsys):
    """``python -m data.splits --help`` rewrote the recorded split (any argument was ignored); help now writes
    nothing, an unknown argument is a usage error (exit status 2), and the rewrite itself goes through a temporary
    file."""
    from data import splits

    record = tmp_path / "essay_split.json"
    monkeypatch.setattr(splits, "SPLIT_FILE", record)
    with pytest.raises(SystemExit) as done:
        splits.main(["--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m data.splits")
    with pytest.raises(SystemExit) as done:
        splits.main(["--budget", "3"])
    assert done.value.code == 2 and not record.exists()
    assert splits.main([]) == 0
    assert record.read_text() == Path(splits.__file__).with_name("essay_split.json").read_text()  # the committed record
    assert list(tmp_path.iterdir()) == [record]


def test_a_packed_split_whose_take_ends_with_its_last_document_of_a_pass_goes_on(tok, monkeypatch):
    """The stream said its split held no text when a take emptied the buffer exactly at the split's last document of
    a pass and the rest of the pass was other splits' documents: it now starts over unless a whole pass gave none."""
    import data.build as build

    docs = [{"text": "train one two"}, {"text": "test three"}, {"text": "test four"}]

    class Rows(list):
        def shuffle(self, seed, buffer_size):  # the stream's order kept, so the take ends where the test says
            return self

    monkeypatch.setattr(build, "_external_rows", lambda source, streaming=False: Rows(docs))
    monkeypatch.setattr(build, "row_split", lambda source, row: row["text"].split()[0])
    stream = build._PackedStream({"task": "jsonl", "path": "docs.jsonl"}, tok, 0, "train")
    n = len(tok("train one two", add_special_tokens=False)["input_ids"]) + 1  # the train document and its EOS
    assert stream.take(n) == stream.take(n)  # the second pass gives it again
    with pytest.raises(ValueError, match="holds no text in the field 'text' to pack in the validation split"):
        build._PackedStream({"task": "jsonl", "path": "docs.jsonl"}, tok, 0, "validation").take(4)
