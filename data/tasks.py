"""Synthetic long-context tasks over the essay splits, each with several templates split into train and eval sets.

Every task builds one example from a haystack of essay text (``data.splits``: train essays for training,
validation essays for checkpoint selection, test essays for every reported evaluation), a few inserted
statements, and a question whose answer is the completion::

    <haystack with statements> \\n\\nQuestion: <question>\\nAnswer: <answer prefix>   ->   " <answer>."

Tasks (RULER-style): ``needle`` (one keyed statement), ``multikey`` (several keys, one asked), ``multivalue``
(one key, several values, all asked), ``kv`` (a block of key: value pairs), ``variable_tracking`` (a chain of
assignments, every variable holding the value asked), ``passkey`` (a repeated pass key), ``common_words``
(the most frequent words of a list; no essay text). Each template belongs to the ``train`` or the ``eval`` set;
the sets never share a template, and the demo's needle template (``configs/eval/demo.yaml``, "the secret
passcode") is an eval template, so a model evaluated on it never saw it in training. Keys are drawn from separate
train and eval word lists too.

Everything is deterministic from ``(seed, index)``: ``make_example(task, tokenizer, split, context_tokens, seed)``
returns the same example for the same arguments.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from data.splits import SPLITS, split_text

ANSWER_FORMAT = "\n\nQuestion: {question}\nAnswer: {answer}"
TEMPLATE_SETS = ("train", "eval")


@dataclass(frozen=True)
class Template:
    """One phrasing of a task.

    Attributes:
        name: unique within the task.
        set: ``"train"`` or ``"eval"``.
        statement: what is inserted into the haystack (``{key}``, ``{value}``; variable tracking: ``{var}`` and
            ``{src}``; kv: one line per pair).
        question: the question asked at the end.
        answer: the answer prefix the model completes.
        first: variable tracking only: the statement that assigns the value itself.
    """

    name: str
    set: str
    statement: str
    question: str
    answer: str
    first: str = ""


TEMPLATES: dict[str, tuple[Template, ...]] = {
    "needle": (
        Template("magic-number", "train", "The special magic number for {key} is {value}.",
                 "What is the special magic number for {key}?", "The special magic number for {key} is"),
        Template("access-code", "train", "The access code for the {key} door is {value}.",
                 "What is the access code for the {key} door?", "The access code for the {key} door is"),
        Template("locker", "train", "Note that {key}'s locker combination is {value}.",
                 "What is {key}'s locker combination?", "{key}'s locker combination is"),
        Template("lucky-number", "train", "Remember that the lucky number of {key} is {value}.",
                 "What is the lucky number of {key}?", "The lucky number of {key} is"),
        Template("serial", "train", "The serial number printed on the {key} box is {value}.",
                 "What is the serial number printed on the {key} box?", "The serial number printed on the {key} box is"),
        # The demo's needle template (configs/eval/demo.yaml): it has no key.
        Template("secret-passcode", "eval", "The secret passcode is {value}.", "What is the secret passcode?",
                 "The secret passcode is"),
        Template("pin", "eval", "The PIN of the {key} account is {value}.", "What is the PIN of the {key} account?",
                 "The PIN of the {key} account is"),
        Template("vault", "eval", "Hidden in the archive: the {key} vault opens with the code {value}.",
                 "Which code opens the {key} vault?", "The {key} vault opens with the code"),
    ),
    "multivalue": (
        Template("lucky-numbers", "train", "One of the lucky numbers of {key} is {value}.",
                 "What are all the lucky numbers of {key}?", "The lucky numbers of {key} are"),
        Template("ticket", "train", "A ticket number held by {key} is {value}.",
                 "Which ticket numbers does {key} hold?", "The ticket numbers {key} holds are"),
        Template("registration", "eval", "One of the registration codes of {key} is {value}.",
                 "What are all the registration codes of {key}?", "The registration codes of {key} are"),
    ),
    "kv": (
        Template("arrow", "train", "{key} -> {value}", "In the list of pairs above, which value does {key} point to?",
                 "The value {key} points to is"),
        Template("json", "train", '"{key}": "{value}",', "In the JSON above, what is the value of key {key}?",
                 "The value of key {key} is"),
        Template("equals", "eval", "{key} = {value}", "In the table of assignments above, what is {key} equal to?",
                 "{key} is equal to"),
    ),
    "variable_tracking": (
        Template("let", "train", "let {var} = {src};", "Which variables end up holding the value {value}?",
                 "The variables holding {value} are", first="let {var} = {value};"),
        Template("set-to", "train", "Set {var} to the value of {src}.", "Which variables were set to {value}?",
                 "The variables set to {value} are", first="Set {var} to {value}."),
        Template("var", "eval", "VAR {var} = VAR {src}", "Find all variables that are assigned the value {value}.",
                 "The variables assigned the value {value} are", first="VAR {var} = {value}"),
        # The answer prefix ends with "VAR", cueing the form of the names: SmolLM2-135M with a full cache finds
        # half to all of a 2-hop chain this way, and none of it with "var" (which starts its answer with ":").
        Template("var-cued", "eval", "VAR {var} = VAR {src}", "Find all variables that are assigned the value {value}.",
                 "The variables assigned the value {value} are VAR", first="VAR {var} = {value}"),
    ),
    "passkey": (
        Template("pass-key", "train", "The pass key is {value}. Remember it. {value} is the pass key.",
                 "What is the pass key?", "The pass key is"),
        Template("unlock", "train", "Keep this in mind: the unlock number is {value}. Again, the unlock number is {value}.",
                 "What is the unlock number?", "The unlock number is"),
        Template("verification", "eval", "Important: the verification token is {value}. The verification token is {value}.",
                 "What is the verification token?", "The verification token is"),
    ),
    "common_words": (
        Template("numbered", "train", "{index}. {word}", "What are the {n} most frequent words in the list above?",
                 "The {n} most frequent words are"),
        Template("commas", "eval", "{word},", "Which {n} words appear most often in the list above?",
                 "The {n} words that appear most often are"),
    ),
}

TASKS = tuple(TEMPLATES)
#: Tasks built from essay haystacks (all but common_words, whose context is the word list itself).
HAYSTACK_TASKS = tuple(t for t in TASKS if t != "common_words")

_KEYS = {
    "train": ("Lisbon", "Oslo", "Nairobi", "Quito", "Hanoi", "Dakar", "Perth", "Tbilisi", "Cusco", "Bergen", "Malmo",
              "Fresno", "Kyoto", "Tunis", "Porto", "Riga", "Accra", "Lima", "Minsk", "Sapporo", "amber", "cobalt",
              "falcon", "juniper", "otter", "maple", "walrus", "saffron", "harbor", "meadow"),
    "eval": ("Ottawa", "Zagreb", "Windhoek", "Montevideo", "Tallinn", "Gdansk", "Adelaide", "Cordoba", "Valencia",
             "Brno", "indigo", "heron", "quartz", "lantern", "glacier", "thistle", "beacon", "cedar", "orchid", "pelican"),
}
_WORDS = ("river", "stone", "paper", "cloud", "garden", "window", "candle", "mirror", "ladder", "basket", "bridge", "pencil",
          "rocket", "island", "forest", "violin", "saddle", "magnet", "anchor", "tunnel", "feather", "blanket", "compass",
          "button", "kettle", "marble", "pillow", "shovel", "teapot", "wallet", "zipper", "helmet", "hammer", "jacket")


#: Each task's options (``make_example``'s keyword arguments besides its template and depth, all positive integers)
#: and their defaults.
OPTIONS: dict[str, dict[str, int]] = {
    "needle": {"digits": 5},
    "multikey": {"digits": 5, "keys": 4},
    "multivalue": {"digits": 5, "values": 3},
    "kv": {"pairs": 8},
    "variable_tracking": {"digits": 5, "hops": 3},
    "passkey": {"digits": 5},
    "common_words": {"top": 3, "distinct": 24},
}


def check_options(task: str, options: dict, template_sets: tuple[str, ...] = TEMPLATE_SETS) -> None:
    """``ValueError`` (one sentence) unless every one of ``options`` is an option of ``task`` (``OPTIONS``) and a
    positive integer the task can draw from its lists with templates of ``template_sets``: at most as many multikey
    ``keys`` as the smallest of those sets' key lists holds, at most as many common-words ``distinct`` words as there
    are, and fewer ``top`` words than ``distinct`` ones."""
    if task not in OPTIONS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(OPTIONS)}")
    for name, value in options.items():
        if name not in OPTIONS[task]:
            raise ValueError(f"{task} takes no option {name!r}; its options: {', '.join(OPTIONS[task])}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    opts = {**OPTIONS[task], **options}
    keys = min(len(_KEYS[s]) for s in template_sets)
    if task == "multikey" and opts["keys"] > keys:
        raise ValueError(f"keys {opts['keys']} is more than the {keys} keys the {' and '.join(template_sets)} templates draw from")
    if task == "common_words" and opts["distinct"] > len(_WORDS):
        raise ValueError(f"distinct {opts['distinct']} is more than the {len(_WORDS)} words common_words draws from")
    if task == "common_words" and opts["top"] >= opts["distinct"]:
        raise ValueError(f"top ({opts['top']}) must be smaller than distinct ({opts['distinct']}): the other words fill the list")


def templates(task: str, template_set: str) -> tuple[Template, ...]:
    """The templates of ``task`` in ``template_set`` (``"train"`` or ``"eval"``)."""
    if task not in TEMPLATES:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if template_set not in TEMPLATE_SETS:
        raise ValueError(f"template set must be one of {TEMPLATE_SETS}, got {template_set!r}")
    return tuple(t for t in TEMPLATES[task] if t.set == template_set)


def template_by_name(task: str, name: str) -> Template:
    for t in TEMPLATES[task]:
        if t.name == name:
            return t
    raise ValueError(f"task {task!r} has no template {name!r}; its templates: {', '.join(t.name for t in TEMPLATES[task])}")


@lru_cache(maxsize=8)
def split_ids(tokenizer: PreTrainedTokenizerBase, split: str) -> tuple[int, ...]:
    return tuple(tokenizer(split_text(split), add_special_tokens=False)["input_ids"])


def n_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def haystack(tokenizer: PreTrainedTokenizerBase, split: str, tokens: int, rng: random.Random) -> str:
    """``tokens`` consecutive tokens of the ``split`` essays from a random start, as text."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    ids = split_ids(tokenizer, split)
    if tokens > len(ids):
        raise ValueError(f"a {tokens}-token haystack exceeds the {split} essays ({len(ids)} tokens)")
    start = rng.randrange(0, len(ids) - tokens + 1)
    return tokenizer.decode(list(ids[start : start + tokens]))


def insert_at_depth(text: str, insert: str, depth: float) -> str:
    """Insert ``insert`` at the sentence boundary closest below ``depth`` (0..1) of ``text``'s characters."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    cut = int(len(text) * depth)
    boundary = text.rfind(". ", 0, cut)
    cut = boundary + 2 if boundary >= 0 else 0
    return text[:cut] + insert + " " + text[cut:]


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def _hex(rng: random.Random, n: int = 8) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def _var(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def _join(items: list[str]) -> str:
    return ", ".join(items)


def _statements(task: str, template: Template, rng: random.Random, keys: tuple[str, ...], options: dict) -> tuple[list[str], list[str], dict]:
    """``(statements to insert, answers, fields of the question and answer prefix)`` of one example."""
    if task == "needle":
        key, value = rng.choice(keys), _digits(rng, options["digits"])
        return [template.statement.format(key=key, value=value)], [value], {"key": key}
    if task == "multikey":
        asked, *others = rng.sample(keys, options["keys"])
        value = _digits(rng, options["digits"])
        pairs = [(asked, value)] + [(k, _digits(rng, options["digits"])) for k in others]
        statements = [template.statement.format(key=k, value=v) for k, v in pairs]
        rng.shuffle(statements)
        return statements, [value], {"key": asked}
    if task == "multivalue":
        key = rng.choice(keys)
        values = [_digits(rng, options["digits"]) for _ in range(options["values"])]
        return [template.statement.format(key=key, value=v) for v in values], values, {"key": key}
    if task == "kv":
        pairs = [(_hex(rng), _hex(rng)) for _ in range(options["pairs"])]
        key, value = rng.choice(pairs)
        return ["\n".join(template.statement.format(key=k, value=v) for k, v in pairs)], [value], {"key": key}
    if task == "variable_tracking":
        value = _digits(rng, options["digits"])
        names = [_var(rng) for _ in range(options["hops"])]
        lines = [template.first.format(var=names[0], value=value)]
        lines += [template.statement.format(var=b, src=a) for a, b in zip(names, names[1:])]
        return lines, names, {"value": value}
    if task == "passkey":
        value = _digits(rng, options["digits"])
        return [template.statement.format(value=value)], [value], {}
    raise ValueError(f"unknown task {task!r}")


#: The fewest haystack tokens an example's statements go into (``make_example``).
MIN_HAYSTACK = 16


def make_example(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    split: str,
    context_tokens: int,
    seed: int,
    template_set: str = "train",
    template: str | None = None,
    depth: float | None = None,
    fit_completion: bool = False,
    **options,
) -> dict:
    """One example of ``task``: ``{task, template, prompt, completion, answers, context_tokens, depth, split, seed}``.

    The prompt takes about ``context_tokens`` tokens, or with ``fit_completion`` the prompt and its completion
    together (a training row, whose sequence length holds both). A ``ValueError`` says when the statements and the
    question leave no room for a haystack of ``MIN_HAYSTACK`` tokens in it (common words: for 4 x ``top`` words).

    ``answers`` lists what a correct completion contains (``data.tasks.score`` checks them). ``depth`` (0..1)
    places the first statement (random if None); later statements of the same example go at random depths after
    it. ``options``: ``digits``, ``values`` (multivalue), ``pairs`` (kv), ``hops`` (variable tracking), ``keys``
    (multikey: how many keyed statements), ``top`` and ``distinct`` (common words); ``OPTIONS`` holds each task's
    and their defaults, ``check_options`` the values it can draw (a ``ValueError`` otherwise).
    """
    if context_tokens < 64:
        raise ValueError(f"context_tokens must be at least 64, got {context_tokens}")
    if split not in SPLITS:  # (here: common_words reads no essay, and took any name as its split)
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    check_options(task, options, (template_set,) if template_set in TEMPLATE_SETS else TEMPLATE_SETS)
    rng = random.Random(f"{task}:{split}:{template_set}:{context_tokens}:{seed}")
    base_task = "needle" if task == "multikey" else task
    pool = templates(base_task, template_set)
    options = {**OPTIONS[task], **options}
    if task == "multikey":
        pool = tuple(t for t in pool if "{key}" in t.statement)
    chosen = template_by_name(base_task, template) if template else rng.choice(pool)
    if chosen.set != template_set:
        raise ValueError(f"template {chosen.name!r} of task {task!r} is a {chosen.set} template, not {template_set}")
    if task == "common_words":
        return _common_words(tokenizer, chosen, rng, context_tokens, seed, split, options, fit_completion)
    statements, answers, fmt = _statements(task, chosen, rng, _KEYS[template_set], options)
    tail = ANSWER_FORMAT.format(question=chosen.question.format(**fmt), answer=chosen.answer.format(**fmt))
    completion = " " + _join(answers) + "."
    overhead = n_tokens(tokenizer, " ".join(statements) + tail) + 2 * len(statements)
    overhead += n_tokens(tokenizer, completion) + 2 if fit_completion else 0
    what = f"its statements, question{', answer' if fit_completion else ''} and a haystack of {MIN_HAYSTACK}"
    _check_room(task, context_tokens, overhead + MIN_HAYSTACK, what, options)
    hay = haystack(tokenizer, split, context_tokens - overhead, rng)
    first = rng.random() if depth is None else depth
    depths = [first] + sorted(rng.uniform(first, 1.0) for _ in statements[1:])
    for d, s in sorted(zip(depths, statements), key=lambda x: -x[0]):  # deepest first keeps earlier offsets valid
        hay = insert_at_depth(hay, s, d)
    return {
        "task": task,
        "template": chosen.name,
        "prompt": hay + tail,
        "completion": completion,
        "answers": answers,
        "context_tokens": context_tokens,
        "depth": first,
        "split": split,
        "seed": seed,
    }


class NoRoomError(ValueError):
    """An example whose parts do not fit its context: ``fact`` says what does not fit, the message adds how to fix it
    where the task is configured (a caller that sets the context itself, such as training's held-out needles, names
    its own options instead)."""

    def __init__(self, fact: str, hint: str):
        super().__init__(f"{fact}; {hint}")
        self.fact = fact


def _check_room(task: str, context_tokens: int, needed: int, what: str, options: dict) -> None:
    """``NoRoomError`` unless the ``needed`` tokens of ``what`` fit ``context_tokens``. A longer example was cut from the
    left: a training row lost the statements its question asks about, and an A/B run's prompts were longer than the
    context its report states."""
    if needed <= context_tokens:
        return
    raise NoRoomError(
        f"{task}: {what} take {needed} tokens, more than its {context_tokens} tokens of context",
        f"give it more context or lower its options ({describe_options(options)})",
    )


def describe_options(options: dict) -> str:
    """A task's options as an error names them (``pairs=32, digits=5``; ``defaults`` for none)."""
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"


def _common_words(
    tokenizer, template: Template, rng: random.Random, context_tokens: int, seed: int, split: str, options: dict, fit_completion: bool
) -> dict:
    top = options["top"]
    vocab = rng.sample(_WORDS, options["distinct"])
    frequent, rest = vocab[:top], vocab[top:]
    tail = ANSWER_FORMAT.format(question=template.question.format(n=top), answer=template.answer.format(n=top))
    completion = " " + _join(frequent) + "."
    per_item = n_tokens(tokenizer, template.statement.format(index=99, word="garden")) + 1
    room = context_tokens - n_tokens(tokenizer, tail) - (n_tokens(tokenizer, completion) + 2 if fit_completion else 0)
    what = f"its question{', answer' if fit_completion else ''} and a list of {4 * top} words (4 x top)"
    _check_room("common_words", context_tokens, context_tokens - room + 4 * top * per_item, what, options)
    items = room // per_item
    words = [frequent[i % top] for i in range(items // 4)]  # each frequent word: ~items / (4 top) times
    words += [rng.choice(rest) for _ in range(items - len(words))]
    rng.shuffle(words)
    lines = [template.statement.format(index=i + 1, word=w) for i, w in enumerate(words)]
    return {
        "task": "common_words",
        "template": template.name,
        "prompt": "\n".join(lines) + tail,
        "completion": completion,
        "answers": frequent,
        "context_tokens": context_tokens,
        "depth": -1.0,
        "split": split,
        "seed": seed,
    }


def score(example: dict, completion: str) -> dict[str, float]:
    """``{"exact": 0/1, "recall": share of answers found}`` for a generated ``completion`` of ``example``.

    Single-answer tasks: exact when the answer appears; recall gives partial credit for the share of its leading
    characters reproduced by the completion's first word-like token (``4393`` for ``43936`` scores 0.8).
    Multi-answer tasks: recall = share of answers that appear; exact = all of them.
    """
    answers = example["answers"]
    if len(answers) == 1:
        answer = answers[0]
        if answer in completion:
            return {"exact": 1.0, "recall": 1.0}
        match = re.search(r"[0-9A-Za-z]+", completion)
        got = match.group() if match else ""
        same = 0
        for a, b in zip(got, answer):
            if a != b:
                break
            same += 1
        return {"exact": 0.0, "recall": same / len(answer)}
    found = sum(a in completion for a in answers)
    return {"exact": float(found == len(answers)), "recall": found / len(answers)}
