"""Preparing and loading models for kvgates."""

import copy
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from helpers import save_tiny_checkpoint, tiny_model

import kvgates
from kvgates import BudgetCache, RetentionGates, UnsupportedModelError, models
from kvgates.models import context_length, embedded_name_of, hub_id_of


def test_prepare_model_keeps_training_mode_and_gradient_checkpointing():
    """Switching the attention implementation must not change the module's mode (a caller may be training)."""
    ref, _ = tiny_model("llama")
    model = copy.deepcopy(ref).train()
    model.activation_checkpointing_enable()
    kvgates.prepare_model(model)
    assert model.config._attn_implementation == "kvgates"
    assert model.training and all(m.training for m in model.modules())
    assert model.is_activation_checkpointing
    model.eval()
    kvgates.prepare_model(model)
    assert not any(m.training for m in model.modules())


def _tiny(config_cls, model_cls, **extra):
    from helpers import _COMMON

    torch.manual_seed(0)
    return model_cls(config_cls(**{**_COMMON, **extra})).eval()


@pytest.mark.parametrize(
    "family,inputs",
    [("gpt_oss", "s_aux"), ("gemma2", "softcap")],
)
def test_models_whose_attention_passes_inputs_kvgates_would_drop_are_refused(family, inputs):
    """GPT-OSS passes its attention sinks (``s_aux``), Gemma-2 a logit soft-cap: dropping either changes the output."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

    if family == "gpt_oss":
        model = _tiny(GptOssConfig, GptOssForCausalLM, num_local_experts=2, num_experts_per_tok=1)
    else:
        model = _tiny(Gemma2Config, Gemma2ForCausalLM)
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match=f"passes {inputs} to its attention function, which kvgates cannot honour"):
        kvgates.prepare_model(model)
    assert model.config._attn_implementation == before  # left as it was


def test_a_model_whose_attention_gets_multimodal_rope_positions_is_refused():
    """GLM-4.5V's attention gets its multimodal RoPE positions ``[3, B, n]``: every budgeted forward stopped in a
    RuntimeError from the layer's positions (``expand``); kvgates orders a layer's tokens by one position each."""
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    text = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, bos_token_id=1,
        eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5},
    )
    vision = dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=32)
    torch.manual_seed(0)
    model = Glm4vMoeForConditionalGeneration(Glm4vMoeConfig(text_config=text, vision_config=vision, image_token_id=120)).eval()
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match=r"\(Glm4vMoeTextAttention\) passes position_ids with 3 positions per token \(multimodal RoPE\)"):
        kvgates.prepare_model(model)
    assert model.config._attn_implementation == before


def test_an_unknown_input_at_call_time_is_refused(tiny):
    """Inputs a caller threads through the forward reach attention too; they are checked on every call."""
    _, model = tiny
    ids = torch.randint(1, 128, (1, 6))
    with pytest.raises(UnsupportedModelError, match="passes attention_bias_scale to its attention function"):
        model(ids, attention_bias_scale=2.0)
    with pytest.raises(UnsupportedModelError, match="passes attention_bias_scale"):
        model(ids, past_key_values=BudgetCache(model.config, "h2o", budget=4), attention_bias_scale=2.0)


def test_prepare_model_dry_run_keeps_the_random_state():
    ref, _ = tiny_model("llama")
    model = copy.deepcopy(ref).train()
    state = torch.random.get_rng_state()
    kvgates.prepare_model(model)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_model_from_a_local_folder_is_named_without_its_path(tmp_path):
    """Adapters record a portable base-model name: never a folder on their author's disk."""
    checkpoint = save_tiny_checkpoint(tmp_path / "my-model")
    model, _ = kvgates.load_model(str(checkpoint))
    assert hub_id_of(model) == "local:my-model" and embedded_name_of(model) is None
    RetentionGates.for_model(model).save_pretrained(tmp_path / "gates")
    config = json.loads((tmp_path / "gates" / "config.json").read_text())
    assert config["base_model"] == "local:my-model" and config["base_model_embedded"] is None
    assert str(tmp_path) not in (tmp_path / "gates" / "config.json").read_text() + (tmp_path / "gates" / "README.md").read_text()


def test_a_model_skeleton_has_the_loaded_models_shapes_and_names_without_weights(tmp_path, monkeypatch):
    """``model_skeleton`` (what ``train.py --check`` measures lengths on): the loaded model's parameters, shapes,
    context and name, every parameter on the meta device."""
    checkpoint = save_tiny_checkpoint(tmp_path / "my-model", max_position_embeddings=777)
    loaded, _ = kvgates.load_model(str(checkpoint))
    skeleton = models.model_skeleton(str(checkpoint))
    assert {n: p.shape for n, p in skeleton.named_parameters()} == {n: p.shape for n, p in loaded.named_parameters()}
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}
    assert context_length(skeleton) == context_length(loaded) == 777
    assert hub_id_of(skeleton) == hub_id_of(loaded) == "local:my-model"


def test_the_embedded_models_skeleton_keeps_its_short_name_without_converting_it(tmp_path, monkeypatch, embedded_package):
    """The embedded model's skeleton keeps its short name (the tokenizer a KVzip repeat prompt is encoded with) and
    is read from its GGUF's config on a machine that has not converted it."""
    embedded = models.model_skeleton("smollm2-135m")
    assert embedded_name_of(embedded) == "smollm2-135m" and hub_id_of(embedded) == models.EMBEDDED_MODELS["smollm2-135m"].hub_id
    assert context_length(embedded) == 8192
    # On a machine that has not converted the embedded model, its GGUF's config: no 15 s, 0.5 GB conversion.
    monkeypatch.setenv("KVGATES_HOME", str(tmp_path / "home"))
    fresh = models.model_skeleton("smollm2-135m")
    assert not (tmp_path / "home" / "models").exists()
    assert {n: p.shape for n, p in fresh.named_parameters()} == {n: p.shape for n, p in embedded.named_parameters()}
    assert context_length(fresh) == 8192 and embedded_name_of(fresh) == "smollm2-135m"
    with pytest.raises(UnsupportedModelError, match="nothing-here does not exist"):
        models.model_skeleton(str(tmp_path / "nothing-here"))


# ------------------------------------------------------------------------------------------------ embedded model cache
@pytest.fixture
def fake_installs(tmp_path, monkeypatch):
    """Two installs (clones, venvs) of the same embedded-model package, and a converter that counts its calls."""
    monkeypatch.setenv("KVGATES_HOME", str(tmp_path / "home"))
    installs = []
    for clone in ("clone-a", "clone-b"):
        gguf = tmp_path / clone / "site-packages" / "model.gguf"
        gguf.parent.mkdir(parents=True)
        gguf.write_bytes(b"GGUF" + bytes(4096))
        installs.append(gguf)
    calls = []

    def convert(gguf, hub_id, folder):
        calls.append(gguf)
        time.sleep(0.3)  # long enough for concurrent callers to overlap
        (folder / "config.json").write_text(json.dumps({"_name_or_path": hub_id}))

    monkeypatch.setattr(models, "convert_gguf", convert)
    return installs, calls


def test_two_installs_share_one_converted_model(fake_installs, monkeypatch):
    installs, calls = fake_installs
    folders = []
    for gguf in installs:
        monkeypatch.setattr(models, "_gguf_path", lambda spec, gguf=gguf: gguf)
        folders.append(models.embedded_model_dir("smollm2-135m"))
    assert folders[0] == folders[1] and len(calls) == 1
    assert folders[0].name.startswith("smollm2-135m-") and json.loads((folders[0] / "config.json").read_text())


def test_the_converted_model_is_readable_as_the_umask_allows(fake_installs, monkeypatch):
    """The conversion's folder gets a plain folder's permissions (mkdtemp's were owner-only, 0o700), and a folder a
    killed conversion left behind is replaced."""
    installs, _ = fake_installs
    monkeypatch.setattr(models, "_gguf_path", lambda spec: installs[0])
    umask = os.umask(0o022)
    try:
        key = models.embedded_key(models.EMBEDDED_MODELS["smollm2-135m"], installs[0])
        (models.kvgates_home() / "models" / f".smollm2-135m-{key}.partial" / "half-written").mkdir(parents=True)
        folder = models.embedded_model_dir("smollm2-135m")
    finally:
        os.umask(umask)
    assert folder.stat().st_mode & 0o777 == 0o755
    assert [p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")] == [folder.name]


def test_concurrent_processes_convert_once(fake_installs, monkeypatch):
    installs, calls = fake_installs
    monkeypatch.setattr(models, "_gguf_path", lambda spec: installs[0])
    with ThreadPoolExecutor(4) as pool:  # a lock file: each caller opens its own handle, as processes do
        folders = list(pool.map(lambda _: models.embedded_model_dir("smollm2-135m"), range(4)))
    assert len(set(folders)) == 1 and len(calls) == 1


def test_an_interrupted_conversion_leaves_nothing_behind(fake_installs, monkeypatch):
    installs, _ = fake_installs
    monkeypatch.setattr(models, "_gguf_path", lambda spec: installs[0])

    def crash(gguf, hub_id, folder):
        (folder / "partial").write_text("x")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        models.embedded_model_dir("smollm2-135m")
    home = models.kvgates_home() / "models"
    assert [p.name for p in home.iterdir() if not p.name.endswith(".lock")] == []


def test_context_length_counts_a_scaled_rotary_embedding():
    """``kvgates.models.context_length``: ``max_position_embeddings``, times the factor of a scaled RoPE (YaRN keeps
    the original length in the config) unless it is already the extended length (Llama 3.1), and None for a config
    without a length."""
    _, model = tiny_model(max_position_embeddings=1024)
    assert context_length(model) == 1024
    model.config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 1e4}
    assert context_length(model) == 4096
    # Llama 3.1 gives the extended length itself (it was 1,048,576 here, and a 200K prompt went unwarned).
    model.config.max_position_embeddings = 131072
    model.config.rope_parameters = {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "rope_theta": 5e5,
    }
    assert context_length(model) == 131072
    # Qwen3's model card enables YaRN past a config of 40,960 positions: 32,768 x 4.
    model.config.max_position_embeddings = 40960
    model.config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    assert context_length(model) == 131072
    lengthless = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda decoder: SimpleNamespace()))
    assert context_length(lengthless) is None


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"device": "gpu"}, ValueError, r"^device: 'gpu' is not a device; use cpu, cuda or cuda:N$"),
        ({"device": "cuda"}, ValueError, r"^device cuda: this machine has no CUDA GPU that torch can use; use device cpu$"),
        ({"device": "cuda:3"}, ValueError, r"^device cuda:3: this machine has no CUDA GPU that torch can use"),
        ({"device": 0}, ValueError, r"^device cuda:0: this machine has no CUDA GPU that torch can use; use device cpu$"),
        ({"device": 1.0}, TypeError, r"^device must be a string such as 'cpu', 'cuda' or 'cuda:N', a torch.device or a CUDA GPU's index, got float$"),
        ({"device": True}, TypeError, r"^device must be .*, got bool$"),
        ({"dtype": "half-ish"}, ValueError, r"^dtype: 'half-ish' is not a dtype models load in; use torch.bfloat16, torch.float16 or"),
        ({"dtype": torch.int8}, ValueError, r"^dtype: torch.int8 is not a dtype models load in"),
        ({"name_or_path": None}, TypeError, r"^name_or_path must be a model folder, a Hugging Face id or an embedded model's name"),
        ({"name_or_path": 3}, TypeError, r"embedded model's name \(smollm2-135m\), got int$"),
    ],
)
def test_load_model_refuses_a_name_dtype_or_device_that_is_not_one_before_anything_loads(tmp_path, monkeypatch, kwargs, error, message):
    """A device torch does not know ("gpu") failed in ``model.to`` with torch's list of device types, a CUDA device on a
    machine without one with torch's AssertionError ("Torch not compiled with CUDA enabled"), both after the weights had
    loaded; a dtype name not among ``DTYPES`` was an AttributeError of ``torch``, an integer dtype transformers' error;
    a name that is no string was said to be missing from the Hugging Face cache."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(models, "_checked_source", lambda name: pytest.fail("a model was looked for"))
    with pytest.raises(error, match=message):
        kvgates.load_model(**{"name_or_path": str(tmp_path), **kwargs})


def test_load_model_takes_a_path_a_dtype_by_name_and_a_torch_device(tmp_path):
    save_tiny_checkpoint(tmp_path / "model")
    model, _ = kvgates.load_model(tmp_path / "model", dtype="bfloat16", device=torch.device("cpu"))
    assert model.dtype == torch.bfloat16 and model.device == torch.device("cpu")
    assert model.config._attn_implementation == "kvgates"
    assert kvgates.load_model(tmp_path / "model", dtype="auto")[0].dtype == torch.float32  # the checkpoint's own


def test_load_tokenizer_is_load_models_tokenizer_without_the_weights(tmp_path, monkeypatch):
    """What a training run builds its data with before the weights load: the tokenizer ``load_model`` returns, its
    padding token set, and ``load_model``'s one sentence for a folder without one."""
    save_tiny_checkpoint(tmp_path / "model")
    _, expected = kvgates.load_model(tmp_path / "model")
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("the weights were read"))
    tokenizer = kvgates.load_tokenizer(tmp_path / "model")
    assert tokenizer("a needle").input_ids == expected("a needle").input_ids and tokenizer.pad_token == expected.pad_token
    for name in os.listdir(tmp_path / "model"):
        if "token" in name:
            os.remove(tmp_path / "model" / name)
    with pytest.raises(UnsupportedModelError, match="tokenizer of .*cannot be loaded .*save the model's tokenizer beside it"):
        kvgates.load_tokenizer(tmp_path / "model")


def test_load_model_takes_any_floating_point_dtype_by_name_and_a_gpu_by_its_index(tmp_path, monkeypatch):
    """``dtype="float64"`` or ``"half"`` loaded as transformers takes a torch dtype's name, and ``device=0`` went to
    ``model.to(0)``, the first CUDA GPU, until bb996b0's checks took only ``DTYPES``' names and a string or a
    ``torch.device`` (``torch.float64`` itself still loaded)."""
    save_tiny_checkpoint(tmp_path / "model")
    assert kvgates.load_model(tmp_path / "model", dtype="float64")[0].dtype == torch.float64
    assert kvgates.load_model(tmp_path / "model", dtype="half")[0].dtype == torch.float16
    moved = []
    monkeypatch.setattr(models, "_check_gpu", lambda place: moved.append(place))
    monkeypatch.setattr(torch.nn.Module, "to", lambda module, *args, **kwargs: moved.append(args) or module)
    kvgates.load_model(tmp_path / "model", device=0)
    assert moved[0] == torch.device("cuda:0") and moved[-1] == (0,)


def test_what_is_no_transformers_model_is_refused_in_one_sentence_wherever_a_model_is_taken():
    """``prepare_model(nn.Linear(...))`` and ``RetentionGates.for_model(model.config)`` failed with the AttributeError
    of ``nn.Module.__getattr__`` or of transformers' config; a string given to a learned policy's ``attach`` or to
    ``model_fingerprint`` with ``'str' object has no attribute 'config'``."""
    _, model = tiny_model("llama")
    policy = kvgates.make_policy("trimkv", budget=8, gates=RetentionGates.for_model(model))
    calls = {
        "prepare_model": kvgates.prepare_model, "check_supported": kvgates.check_supported,
        "model_fingerprint": kvgates.model_fingerprint, "for_model": RetentionGates.for_model, "attach": policy.attach,
        "check_shapes": policy.gates.check_shapes,
    }
    for call in calls.values():
        for wrong in (torch.nn.Linear(2, 2), model.config, "smollm2-135m"):
            with pytest.raises(TypeError, match=rf"^model must be a transformers model \(a PreTrainedModel, .*\), got {type(wrong).__name__}$"):
                call(wrong)


@pytest.mark.parametrize("version", [0, 4, "3", None])
def test_a_fingerprint_of_a_version_no_adapter_has_is_refused_in_one_sentence(version):
    """``model_fingerprint(model, 4)`` was a bare ``KeyError: 4``."""
    _, model = tiny_model("llama")
    with pytest.raises(ValueError, match=rf"^version must be an adapter format version, 1 to 3, got {version!r}$"):
        kvgates.model_fingerprint(model, version)
    assert kvgates.model_fingerprint(model, 3) == kvgates.model_fingerprint(model)


def test_a_model_folder_in_the_home_folder_loads_by_a_path_that_begins_with_a_tilde(tmp_path, monkeypatch):
    """``load_model("~/models/tiny")`` of a folder that is there said "~/models/tiny does not exist": the path was taken
    for a local one (it begins with ``~``) and never expanded (nor is it by a shell in ``--model=~/models/tiny`` or a
    YAML config)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    save_tiny_checkpoint(tmp_path / "models" / "tiny")
    model, _ = kvgates.load_model("~/models/tiny")
    assert hub_id_of(model) == "local:tiny"
    models.check_model_source("~/models/tiny")
    assert models.model_skeleton("~/models/tiny").config.num_hidden_layers == model.config.num_hidden_layers
    with pytest.raises(UnsupportedModelError, match=rf"^{tmp_path}/models/missing does not exist; pass a model folder"):
        kvgates.load_model("~/models/missing")


def test_a_model_torch_compile_or_peft_wrapped_is_taken_as_the_model_it_wraps():
    """``require_model`` refused ``torch.compile(model)`` (an ``OptimizedModule``) and peft's ``get_peft_model(model)``,
    which a learned policy's ``attach`` with ``strict=False`` took before; their fingerprint (parameter names under
    the wrapper's prefix) was no model's, so ``strict=True`` refused the very model the gates were made for."""
    from peft import LoraConfig, get_peft_model

    _, model = tiny_model("llama")
    gates = RetentionGates.for_model(model)
    compiled = torch.compile(model, backend="eager")  # (never called: nothing compiles)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"]))
    for wrapped in (compiled, peft_model, torch.compile(peft_model, backend="eager")):
        assert kvgates.model_fingerprint(wrapped) == gates.config.fingerprint
        kvgates.check_supported(wrapped)
        assert RetentionGates.for_model(wrapped).config.fingerprint == gates.config.fingerprint
        kvgates.make_policy("trimkv", budget=8, gates=gates).attach(wrapped).detach()
    with pytest.raises(TypeError, match=r"^model must be a transformers model .*, got OptimizedModule$"):
        kvgates.model_fingerprint(torch.compile(torch.nn.Linear(2, 2), backend="eager"))


def test_load_model_and_model_skeleton_take_any_os_pathlike(tmp_path):
    """``load_model`` says it takes an ``os.PathLike`` (bb996b0), but read one that is not pathlib's through ``str()``,
    its repr: ``'<...Folder object at 0x...>' is neither a model folder nor a Hugging Face id``."""

    class Folder(os.PathLike):
        def __init__(self, path):
            self.path = path

        def __fspath__(self):
            return str(self.path)

    save_tiny_checkpoint(tmp_path / "model")
    model, _ = kvgates.load_model(Folder(tmp_path / "model"))
    assert model.config._name_or_path == str(tmp_path / "model")
    assert models.model_skeleton(Folder(tmp_path / "model")).config._name_or_path == str(tmp_path / "model")
