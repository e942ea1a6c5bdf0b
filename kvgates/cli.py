"""Command line: ``kvgates generate``, ``kvgates policies``, ``kvgates --version``.

    kvgates generate --model smollm2-135m --policy snapkv --budget 256 --prompt-file essay.txt --window 16

    kvgates generate --policy trimkv --budget 128 --prompt-file essay.txt     # the shipped adapter on the embedded model

Every parameter of the chosen policy is an option (``kvgates generate --policy snapkv --help`` lists them); a learned
policy without ``--gates`` on an embedded model runs the adapter shipped for it (``kvgates.gates.embedded``). The
generated text is the only thing written to stdout; the KV memory report (naming the adapter a learned policy ran)
and every error go to stderr. Every user error (a bad option, model, adapter or prompt) is one sentence and exit
status 2; help goes to stdout. A prompt that runs past the model's context is warned about in one line, not
refused; a long one (2,048 tokens or more) gets a line on stderr as its prefill starts and one as it ends. torch
and transformers are imported only by ``generate`` and ``policies``, so ``kvgates --version`` and ``kvgates --help``
answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import os
import re
import sys
import time
import typing
from pathlib import Path
from typing import Any, NoReturn

import kvgates

#: The exit status of every user error (a bad option, model, adapter or prompt): one sentence on stderr.
USAGE_ERROR = 2
#: Exit status when the reader of the output left early: a tool that SIGPIPE ends gives 128 + 13.
BROKEN_PIPE = 141
#: Exit status when stopped with Ctrl-C: a tool that SIGINT ends gives 128 + 2.
INTERRUPTED = 130
#: Exit status when standard output takes no more (``> /dev/full``, a full disk), as ``cat`` and ``echo`` give.
WRITE_ERROR = 1

#: ``kvgates generate --sample``'s temperature when ``--temperature`` is not given.
TEMPERATURE = 0.7
#: A prompt of this many tokens or more is long: ``kvgates generate`` says on stderr when its prefill starts and ends.
LONG_PROMPT = 2048


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2), not the usage block; every command of
    the project (``kvgates``, ``python -m eval``, ``train.py``, ``python -m train.ship``) parses with it."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def print_help(self, file: typing.TextIO | None = None) -> None:
        """Write the help to ``file`` (default: standard output) and flush it, a failed write raised: argparse's own
        ignores it, so ``--help > /dev/full`` or ``--help | head -0`` ended with status 0; ``quiet_exits`` now ends
        them as any other output (status 1 with one sentence, or SIGPIPE's status)."""
        file = sys.stdout if file is None else file
        if file is not None:  # (None under pythonw: nothing to write to)
            file.write(self.format_help())
            file.flush()


def plain(text: str | None) -> str:
    """``text`` (a docstring, or a line of one) as help text: reStructuredText's inline literals, written between
    double backticks, between single ones (as a terminal shows them); None as an empty text. Every command's help
    that comes from a docstring (``description=plain(__doc__)``) goes through it."""
    return (text or "").replace("``", "`")


def usage_error(prog: str, err: BaseException) -> int:
    """Print ``err`` as one line, ``PROG: message``, on stderr and return ``USAGE_ERROR`` (the exit status of a
    command's user error)."""
    print(f"{prog}: {' '.join(str(err).split())}", file=sys.stderr)
    return USAGE_ERROR


def require_installed(prog: str, modules: typing.Iterable[str], extra: str = "train") -> None:
    """Exit with ``USAGE_ERROR`` and one sentence on stderr where one of ``modules`` (import names), which ``prog``
    needs and the ``extra`` of kvgates installs, is not installed: the core alone (``pip install -e .``) running
    a script of the repository said so in a traceback, some only once the model had loaded. Imports nothing."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        print(f"{prog}: {', '.join(missing)} {verb} not installed here; {prog} needs kvgates' {extra!r} extra: "
              f"pip install -e '.[{extra}]' in the repository (make setup installs it)", file=sys.stderr)
        raise SystemExit(USAGE_ERROR)


def _int(text: str) -> int:
    """A whole number torch takes (int64: a larger one overflows where it meets a tensor, once the model loaded)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if abs(value) >= 2**63:
        raise argparse.ArgumentTypeError(f"must be a whole number below 2**63, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _prefill_chunk(text: str) -> int:
    """A prompt chunk: at least 2 tokens, since the cache takes a single-token call after the prompt for a decode step
    (``BudgetLayer.phase``): chunks of one would leave the whole prompt uncompressed."""
    value = _positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be at least 2 tokens, got {text!r} (a one-token call after the prompt is a decode step, so the prompt "
            "would never be compressed)"
        )
    return value


def _seed(text: str) -> int:
    """A ``--seed``: a whole number torch's generator takes (0 to 2**64 - 1)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be a whole number from 0 to 2**64 - 1, got {text!r}")
    return value


def _file_name(text: str) -> Path:
    """A file named on the command line (an empty name is refused: ``Path("")`` would be the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the file name is empty")
    return Path(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r} (greedy decoding is the default: leave out --sample)")
    return value


def _int_list(text: str) -> list[int]:
    """A list of whole numbers, comma-separated (``--repeat-ids 504,1234``)."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _documented_args(cls: type) -> dict[str, str]:
    """What the ``Args:`` sections of ``cls``'s docstrings (its own, then its bases') say of each parameter: an entry
    ``name: text`` with its continuation lines, and ``a: text; b: text`` entries split at each ``; name:``."""
    entries: dict[str, str] = {}
    for klass in cls.__mro__:
        lines = (klass.__dict__.get("__doc__") or "").splitlines()
        start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
        if start is None:
            continue
        found: list[list[str]] = []
        indent = None  # the entries' indentation; a line indented more continues the entry before it
        for line in lines[start + 1 :]:
            text = line.strip()
            if not text:
                break
            depth = len(line) - len(line.lstrip())
            if indent is None or depth <= indent:
                indent = depth
                found.append([text] if re.match(r"^\w+: ", text) else [])
            elif found:
                found[-1].append(text)
        for entry in filter(None, found):
            for part in re.split(r";\s+(?=\w+: )", " ".join(entry)):
                name, _, said = part.partition(": ")
                entries.setdefault(name, plain(said).rstrip("."))
    return entries


def _policy_options(parser: argparse.ArgumentParser, policy: str) -> list[str]:
    """Add one option per parameter of ``policy`` (except budget), each with what the policy's docstring says of it
    and its default; return their names."""
    cls = kvgates.POLICIES[policy]
    hints = typing.get_type_hints(cls)
    documented = _documented_args(cls)
    names = []
    group = parser.add_argument_group(f"{policy} parameters")
    for f in dataclasses.fields(cls):
        if not f.init or f.name == "budget":
            continue
        hint = hints.get(f.name)
        args = typing.get_args(hint)
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        kind = {bool: _bool, int: _int, float: float, str: str, list[int]: _int_list}.get(base, str)
        if f.name == "gates":  # a learned policy: without --gates, the shipped adapter (_shipped_gates)
            text = ("a gate adapter: folder, Hub id or shipped name (default on the embedded model: the adapter shipped "
                    "for this policy, trained nearest --budget)")
        else:
            factory = f.default_factory if f.default_factory is not dataclasses.MISSING else lambda: None
            said = documented.get(f.name, "")
            default = f"default: {f.default if f.default is not dataclasses.MISSING else factory()}"
            text = (said if "default" in said else f"{said} ({default})" if said else default).replace("%", "%%")
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=None, help=text)
        names.append(f.name)
    return names


def _shipped_gates(parser: argparse.ArgumentParser, model: str, policy: str, budget: int | None, option: str) -> str:
    """The adapter shipped for ``policy`` on the embedded ``model`` (the one trained nearest ``budget``), or a usage
    error naming ``option`` when none ships."""
    from kvgates.gates.embedded import default_gates

    gates = default_gates(model, policy, budget)
    if gates is None:
        parser.error(f"--policy {policy} needs {option} (a gate adapter folder or Hub id); no adapter ships for {model}")
    return gates


def _adapter_of(policy: kvgates.Policy) -> kvgates.GateSet | None:
    """The gate adapter ``policy`` runs (a wrapper's base's), or None where no learned policy runs."""
    from kvgates.policies.learned import LearnedPolicy
    from kvgates.policies.wrappers import Wrapper

    while isinstance(policy, Wrapper):
        policy = policy.inner
    return policy.gates if isinstance(policy, LearnedPolicy) else None


#: ``kvgates generate --dtype``: the model's parameter dtypes by name (``auto``: ``kvgates.models.device_and_dtype`` picks),
#: ``kvgates.models.DTYPES`` and ``auto`` written out here: ``--help`` imports no torch.
DTYPES = ("auto", "bfloat16", "float16", "float32")


def _generate(argv: list[str]) -> int:
    import torch

    from kvgates import POLICIES, AdapterError, BudgetCache, load_model, make_policy
    from kvgates.models import device_and_dtype, model_skeleton
    from kvgates.policies.wrappers import Wrapper, learned_params, learned_policy, with_gates

    pre = OneLineParser(prog="kvgates generate", add_help=False)  # its errors (--policy without a name) as the parser's
    pre.add_argument("--policy", default="full")
    known, _ = pre.parse_known_args(argv)
    if known.policy not in POLICIES:
        print(f"kvgates generate: unknown policy {known.policy!r}; available policies: {', '.join(sorted(POLICIES))}", file=sys.stderr)
        return USAGE_ERROR
    parser = OneLineParser(
        prog="kvgates generate", description="Generate text with a budgeted KV cache.",
        epilog="Each parameter of the chosen policy is an option: kvgates generate --policy NAME --help lists them.",
    )
    parser.add_argument("--model", default="smollm2-135m", help="'smollm2-135m' (embedded), a Hub id or a local folder")
    parser.add_argument(
        "--policy", default="full", choices=sorted(POLICIES),
        help="the eviction policy (kvgates policies describes each; default: full)",
    )
    parser.add_argument("--budget", type=_int, help="tokens kept per KV head and layer (not for --policy full)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", type=_file_name, help="a file holding the prompt (/dev/stdin: read from a pipe)")
    parser.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=None,
        help="wrap the prompt in the model's chat template (default: when the tokenizer has one; --no-chat for raw text)",
    )
    parser.add_argument("--max-new-tokens", type=_positive_int, default=64, help="default: 64")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=_positive_float, help=f"sampling temperature with --sample (default: {TEMPERATURE})")
    parser.add_argument("--seed", type=_seed, help="the random seed of --sample (default: 0)")
    parser.add_argument(
        "--prefill-chunk", type=_prefill_chunk,
        help="feed the prompt in chunks of this many tokens (at least 2: a one-token call after the prompt is a decode step)",
    )
    parser.add_argument(
        "--device", default="auto", help="where the model and its cache run: auto (a CUDA GPU where there is one, else the CPU), cpu, cuda, cuda:N"
    )
    parser.add_argument(
        "--dtype", default="auto", choices=sorted(DTYPES),
        help="the model's weights and cache: auto (bfloat16 on a GPU that computes in it, float16 on an older one, else float32)",
    )
    names = _policy_options(parser, known.policy)
    args = parser.parse_args(argv)
    try:
        device, dtype = device_and_dtype(args.device, args.dtype, prefix="--", command="kvgates generate", auto=True)
    except ValueError as err:
        parser.error(str(err))
    if args.temperature is not None and not args.sample:
        parser.error("--temperature sets how --sample samples; add --sample (greedy decoding, the default, has no temperature)")
    if args.seed is not None and not args.sample:
        parser.error("--seed sets what --sample draws; add --sample (greedy decoding, the default, gives the same text every run)")

    params = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.budget is not None:
        params["budget"] = args.budget
    # A learned policy on an embedded model runs the adapter shipped for it (the one trained nearest the budget)
    # unless --gates names another; so does a learned base inside a wrapper (--policy adakv --base trimkv-snap)
    # unless --base-params names gates.
    learned, wrapped = learned_policy(args.policy, params), issubclass(POLICIES[args.policy], Wrapper)
    try:
        given = learned_params(args.policy, params)
    except ValueError as err:
        parser.error(f"--base-params: {err}")
    if learned is not None and "gates" not in given:
        option = "--base-params gates=..." if wrapped else "--gates"
        params = with_gates(args.policy, params, _shipped_gates(parser, args.model, learned.name, params.get("budget"), option))
    try:
        policy = make_policy(args.policy, **params)
    except ValueError as err:
        parser.error(str(err))
    if args.prompt_file is not None:
        if args.prompt_file.is_dir():
            parser.error(f"prompt file {args.prompt_file} is a folder; name a text file")
        if not args.prompt_file.exists():  # not is_file(): a pipe (/dev/stdin, a shell's <(...)) is read as well
            parser.error(f"prompt file {args.prompt_file} does not exist")
        try:
            prompt = args.prompt_file.read_text(encoding="utf-8-sig")  # a leading byte order mark (Notepad's) is no text
        except UnicodeDecodeError:
            parser.error(f"prompt file {args.prompt_file} is not UTF-8 text")
    else:
        prompt = args.prompt
    if not prompt.strip():
        parser.error("the prompt is empty")

    # Libraries may print (DeepSpeed's accelerator notice, progress bars): nothing but the text goes to stdout.
    with contextlib.redirect_stdout(sys.stderr):
        gate_set = _adapter_of(policy)
        if gate_set is not None:  # gates of another model's shapes: refused from the model's config, before its weights load
            gate_set.check_shapes(model_skeleton(args.model))
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
        templated = bool(getattr(tokenizer, "chat_template", None))
        if args.chat and not templated:
            parser.error(f"--chat: the tokenizer of {args.model} has no chat template; leave out --chat to send the prompt as it is")
        chat = args.chat if args.chat is not None else templated
        if chat:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        # The template writes its own special tokens (Llama 3's and Gemma 3's BOS): the tokenizer adds none twice, as
        # apply_chat_template(tokenize=True) does.
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=not chat).to(model.device)
        _warn_past_context(model, args.model, inputs["input_ids"].shape[1], args.max_new_tokens, policy, args.prefill_chunk)
        try:
            policy.attach(model)  # learned policies hook their gate inputs; heuristics need nothing
        except AdapterError as err:  # the library names its own argument; say the option that does the same
            strict = "add strict=false to --base-params" if wrapped else "pass --strict false"
            raise AdapterError(str(err).replace("pass strict=False", strict)) from None
        cache = BudgetCache(model.config, policy)
        torch.manual_seed(args.seed or 0)
        prompt_tokens = inputs["input_ids"].shape[1]
        notice = _PrefillNotice(prompt_tokens, args.prefill_chunk, device, dtype) if prompt_tokens >= LONG_PROMPT else None
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                **inputs,
                past_key_values=cache,
                max_new_tokens=args.max_new_tokens,
                do_sample=args.sample,
                temperature=(args.temperature or TEMPERATURE) if args.sample else None,
                top_p=None,
                top_k=None,
                prefill_chunk_size=args.prefill_chunk,
                pad_token_id=tokenizer.pad_token_id,
                streamer=notice,
            )
        seconds = time.perf_counter() - start
    new = out[0, prompt_tokens:]
    print(tokenizer.decode(new, skip_special_tokens=True))
    # generate() never runs the last new token through the model, so the cache saw all but it: the memory figures
    # are those of the tokens it saw (as a full cache's would be after the same run), the token count the text's.
    seen = cache.get_seq_length()
    held, allocated, full = cache.held_bytes(), cache.kv_bytes(), cache.full_bytes()
    gates = learned_params(args.policy, params).get("gates") if learned is not None else None
    adapter = f" gates={gates}" if gates is not None else ""
    print(
        f"\n[kvgates] policy={policy.name}{adapter} tokens={prompt_tokens + len(new)} (prompt {prompt_tokens}, new {len(new)}"
        f"{', chat' if chat else ''}; the cache saw {seen}, all but the last new token) "
        f"KV held {held / 2**20:.2f} MiB vs full cache {full / 2**20:.2f} MiB ({held / full:.1%}), "
        f"allocated {allocated / 2**20:.2f} MiB; {seconds:.1f} s on {device} ({str(dtype).removeprefix('torch.')})",
        file=sys.stderr,
    )
    return 0


class _PrefillNotice:
    """A ``generate()`` streamer (``transformers``' ``BaseStreamer`` interface; not its subclass, so that importing the
    CLI imports no transformers) that says on stderr, in a line each, when a long prompt's prefill starts (generate()
    hands it the prompt) and when it has ended (the first new token): a sign of life on a prefill of minutes. stdout,
    which holds only the generated text, is left alone."""

    def __init__(self, tokens: int, chunk: int | None, device: Any, dtype: Any) -> None:
        self.tokens, self.chunk, self.place = tokens, chunk, f"on {device} in {str(dtype).removeprefix('torch.')}"
        self.start: float | None = None
        self.done = False

    def put(self, value: Any) -> None:
        """Take generate()'s tokens: first the prompt's, then each new token's."""
        if self.start is None:
            chunks = f", in chunks of {self.chunk}" if self.chunk is not None and self.chunk < self.tokens else ""
            print(f"kvgates generate: prefilling the prompt ({self.tokens} tokens{chunks}) {self.place} ...", file=sys.stderr, flush=True)
            self.start = time.perf_counter()
        elif not self.done:
            self.done = True
            print(f"kvgates generate: prompt prefilled; first new token after {time.perf_counter() - self.start:.1f} s", file=sys.stderr, flush=True)

    def end(self) -> None:
        """Nothing left to say: the run's summary follows."""


def _warn_past_context(model: Any, name: str, prompt: int, new: int, policy: kvgates.Policy, chunk: int | None) -> None:
    """Say on stderr, in one sentence, when attention runs past the model's context (``kvgates.models.context_length``):
    eviction bounds the cache, not the positions, which keep counting, and a policy's scoring forwards run after the
    prompt (``Policy.scoring_reach``); a policy attending at positions within its cache (``Policy.position_window``)
    still attends a prompt forward's own tokens at their ranks after the cache's, so a prompt fed in one forward (no
    ``--prefill-chunk``) reaches its own length."""
    from kvgates.models import context_length, past_context

    reach, window = policy.scoring_reach(model, prompt), policy.position_window
    past = past_context(model, name, prompt + max(new, reach))
    if past is None:
        return
    limit = context_length(model)
    if window is None:
        if new >= reach:
            after, why = f"--max-new-tokens {new}", "eviction bounds the cache, not the positions, so the text may be garbled"
        else:
            after, why = f"the {reach} positions {policy.name}'s scoring forwards take after it", f"{policy.name} may keep the wrong tokens"
        print(f"kvgates generate: warning: the prompt ({prompt} tokens) and {after} {past}; {why}", file=sys.stderr)
    elif window + (chunk or prompt) > limit:
        fix = f"pass --prefill-chunk {limit - window} or less" if window < limit else "lower --budget"
        print(
            f"kvgates generate: warning: re-rotated attention over a {window}-token cache and a prompt forward of "
            f"{chunk or prompt} tokens runs past the {limit} positions {name} was trained on; {fix}",
            file=sys.stderr,
        )


def _policies(argv: list[str]) -> int:
    from kvgates import POLICIES

    OneLineParser(prog="kvgates policies", description="List the registered policies, each with its docstring's first line.").parse_args(argv)
    for name in sorted(POLICIES):
        doc = plain(POLICIES[name].__doc__).strip().splitlines()[0]  # as the options' help
        print(f"{name:16s} {doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return quiet_exits(lambda: _main(argv), "kvgates")


def _main(argv: list[str]) -> int:
    commands = {"generate": _generate, "policies": _policies}
    if argv[:1] == ["--version"]:
        print(f"kvgates {kvgates.__version__}")
        return 0
    usage = "usage: kvgates {generate,policies} [options] | kvgates --version\n\n" + plain(__doc__)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not argv or argv[0] not in commands:
        what = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"kvgates: {what}; commands: generate, policies (see kvgates --help)", file=sys.stderr)
        return USAGE_ERROR
    import transformers

    transformers.utils.logging.set_verbosity_error()  # library notices and progress bars are not for the command line
    transformers.utils.logging.disable_progress_bar()

    try:
        return commands[argv[0]](argv[1:])
    except BrokenPipeError:  # (an OSError, but quiet_exits' to end)
        raise
    except (ValueError, OSError) as err:  # bad parameters, AdapterError, UnsupportedModelError, a model that cannot load
        if isinstance(err, OSError) and stdout_failure() is not None:
            raise  # (quiet_exits says so)
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"kvgates {argv[0]}: {message}", file=sys.stderr)  # the command's name, as its parser's errors give it
        return USAGE_ERROR


def quiet_exits(command: typing.Callable[[], int | None], prog: str | None = None) -> int:
    """``command()``'s exit status (0 for None), ending as a Unix tool does, not in a traceback of wherever the work
    was: a reader that left early (``... | head``) ends it quietly with SIGPIPE's status (``BROKEN_PIPE``), Ctrl-C
    quietly with SIGINT's (``INTERRUPTED``), and a standard output that takes no more (``> /dev/full``,
    ``stdout_failure``) with one sentence on stderr and ``WRITE_ERROR``. Every other error passes on. ``prog`` names
    the command in that sentence (default: the script's file name, as argparse's). Every command of the project runs
    through it; one says on stderr what an interruption leaves before it re-raises."""
    try:
        code = command()
        sys.stdout.flush()  # a closed pipe or a full device is found here, not at exit
        return code or 0
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return BROKEN_PIPE
    except KeyboardInterrupt:
        return INTERRUPTED
    except OSError as err:
        failure = stdout_failure()
        if failure is None:  # not standard output's
            raise
        print(f"{prog or Path(sys.argv[0]).name}: cannot write to standard output ({failure.strerror or err})", file=sys.stderr)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (its text would fail again at exit)
        return WRITE_ERROR


def stdout_failure() -> OSError | None:
    """Why standard output takes no more text, or None where it does (or is no file: a stream in memory): what it
    holds cannot be flushed, or its file refuses even an empty write (``/dev/full``, when an unbuffered stream,
    ``PYTHONUNBUFFERED``, holds nothing to flush). None too where there is no standard output to ask (None under
    ``pythonw``, closed, or an object with no file): an error of the command's own is then not hidden behind that."""
    try:
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), b"")
    except (io.UnsupportedOperation, AttributeError, ValueError):
        return None
    except OSError as err:
        return err
    return None


if __name__ == "__main__":
    sys.exit(main())
