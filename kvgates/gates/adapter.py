"""Gate adapters: a trained (or fresh) set of per-layer gate modules for one base model, as a Hub-shareable folder.

A folder holds ``config.json`` (kind, version, base model id and fingerprint, shapes, training budget, training
data summary, results), ``model.safetensors`` (gate parameters only) and ``README.md`` (a model card).
``save_pretrained`` / ``from_pretrained`` (local folder or Hub id) / ``push_to_hub`` follow the 🤗 conventions.
Loading never unpickles (safetensors only), and a missing, truncated or corrupt file, an unknown kind or a
shape mismatch each raise ``AdapterError`` with one sentence saying what is wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from kvgates.config import output_path
from kvgates.errors import AdapterError, HubPushError, UnsupportedModelError
from kvgates.gates.modules import GlobalRetentionTrunk, RetainingHead, RetentionGate, SharedRetentionHead
from kvgates.typecheck import field_problems

#: Version 3: the model fingerprint is the same for a float32, a bfloat16 and a float16 load (version 2: float32 and
#: bfloat16; ``kvgates.models.model_fingerprint``); an adapter is checked against its own version's fingerprint.
ADAPTER_VERSION = 3
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "README.md"

GATE_KINDS: dict[str, type[GateSet]] = {}


@dataclass
class GateConfig:
    """What a gate adapter is for and how it is shaped (``config.json``).

    ``base_model`` is portable: the base model's Hugging Face id (for an embedded model, the id its weights came
    from, with ``base_model_embedded`` its short name in kvgates), never a path on the author's disk.
    """

    kind: str
    base_model: str
    fingerprint: str
    num_layers: int
    layer_ids: list[int]
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    gate_hidden: int
    activation: str = "silu"
    init_bias: float = 18.0
    base_model_embedded: str | None = None
    training_budget: int | None = None
    training_data: str | None = None
    results: dict[str, Any] = field(default_factory=dict)
    #: How the gates were trained: recipe (the run config), command, wall time, machine, data split.
    training: dict[str, Any] = field(default_factory=dict)
    #: Markdown results (held-out and A/B tables) shown in the model card.
    report: str = ""
    version: int = ADAPTER_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "config.json") -> GateConfig:
        if not isinstance(data, dict):
            raise AdapterError(f"{source} must hold a JSON object, got {type(data).__name__}")
        if "kind" not in data and ("model_type" in data or "architectures" in data):
            raise AdapterError(
                f"{source} is the config of a model ({data.get('model_type') or 'transformers'}), not of a kvgates gate adapter; "
                "load a base model with kvgates.load_model and pass gates as an adapter folder, a shipped adapter's name or an adapter's Hub id"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise AdapterError(f"{source} lacks {', '.join(missing)}; it is not a kvgates gate adapter config")
        unknown = sorted(set(data) - names)
        if unknown:
            raise AdapterError(f"{source} has unknown fields {', '.join(unknown)} (written by a newer kvgates?)")
        wrong = field_problems(cls, data)
        if wrong:
            raise AdapterError(f"{source}: {wrong[0]}; the file is corrupt or was edited by hand")
        if data.get("version", ADAPTER_VERSION) > ADAPTER_VERSION:
            raise AdapterError(f"{source} is adapter format version {data['version']}; this kvgates reads up to {ADAPTER_VERSION}")
        if data.get("version", ADAPTER_VERSION) < 1:
            raise AdapterError(
                f"{source} is adapter format version {data['version']}, which no kvgates wrote; the file is corrupt or was edited by hand"
            )
        if data["kind"] not in GATE_KINDS:
            raise AdapterError(f"{source} names gate kind {data['kind']!r}; known kinds: {', '.join(sorted(GATE_KINDS))}")
        config = cls(**data)
        config.check_ranges(source)
        return config

    def check_ranges(self, source: str = "config.json") -> None:
        """``AdapterError`` for shapes no gate can have (a size below 1, gated layers outside ``num_layers``) or an
        activation transformers does not know, so a bad config fails when it is read, not when the model loads."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "gate_hidden"):
            if getattr(self, name) < 1:
                raise AdapterError(f"{source}: {name} must be at least 1, got {getattr(self, name)}; the file is corrupt or was edited by hand")
        ids = self.layer_ids
        if not ids or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers for i in ids) or len(set(ids)) != len(ids):
            raise AdapterError(f"{source}: layer_ids must list distinct layers from 0 to num_layers - 1 ({self.num_layers - 1}), got {ids}")
        if self.activation not in ACT2FN:
            raise AdapterError(f"{source}: unknown activation {self.activation!r}; transformers knows {', '.join(sorted(ACT2FN))}")
        if self.training_budget is not None and self.training_budget < 1:
            raise AdapterError(
                f"{source}: training_budget must be at least 1 (or null), got {self.training_budget}; the file is corrupt or was edited by hand"
            )
        if not math.isfinite(self.init_bias):
            raise AdapterError(f"{source}: init_bias must be a finite number, got {self.init_bias}; the file is corrupt or was edited by hand")


def gated_layers(model: PreTrainedModel) -> list[int]:
    """The layers of ``model`` that gates sit on: its full-attention ones, those a ``BudgetCache`` budgets (sliding-window
    and chunked-attention layers keep transformers' own cache and attention). ``UnsupportedModelError`` (one sentence)
    for a model without one (Mistral-7B-v0.1 and Phi-3-mini-4k declare a sliding window for every layer): its gates
    had no layer, no parameter, and a training run stopped at its first loss with torch.stack's traceback."""
    from kvgates.runtime.cache import layer_kinds

    config = model.config.get_text_config(decoder=True)
    layer_types, _ = layer_kinds(config)
    layers = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    if not layers:
        raise UnsupportedModelError(
            f"{config.model_type!r} has no full-attention layer (all layers use sliding or chunked attention), so there is "
            "no layer for gates to sit on"
        )
    return layers


def _geometry(model: PreTrainedModel) -> dict[str, Any]:
    config = model.config.get_text_config(decoder=True)
    return dict(
        num_layers=config.num_hidden_layers,
        layer_ids=gated_layers(model),
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        activation=getattr(config, "hidden_act", "silu"),
    )


def atomic_write(path: Path, write: Callable[[str], Any]) -> None:
    """Write through a temporary file in the same folder, so an interrupted save leaves the old file intact. The
    file gets the permissions a plain ``open`` would give it (``0o666`` less the umask), not ``mkstemp``'s
    owner-only ``0o600``."""
    atomic_write_all([(path, write)])


def atomic_write_all(files: Sequence[tuple[Path, Callable[[str], Any]]]) -> None:
    """``atomic_write`` of several files that belong together: each is written through its temporary file first,
    and only then are all moved into place, so that an error or a Ctrl-C while writing (the time a save takes)
    leaves every old file as it was, not some files new beside others old. Should a move fail (a folder where a
    file goes, a Ctrl-C between two moves), the moves already made are undone: each old file was kept aside
    (``_keep_aside``) and is put back, and a file that did not exist before is removed. Once the last move is made
    the save is whole and stays (``atomic_write``'s one file keeps nothing aside)."""
    umask = os.umask(0)
    os.umask(umask)
    staged: list[tuple[str, Path]] = []
    kept: list[str] = []  # the old files kept aside
    moves: list[tuple[str, Path, str | None]] = []  # each move begun: its temporary file, its path, its old file kept aside (None: none)
    try:
        for path, write in files:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            os.close(fd)
            staged.append((tmp, path))
            write(tmp)
            os.chmod(tmp, 0o666 & ~umask)
        for i, (tmp, path) in enumerate(staged):
            # (the last move keeps nothing aside: once it is made the save is whole, and none is left to fail)
            old = _keep_aside(path, kept) if i < len(staged) - 1 and (os.path.isfile(path) or os.path.islink(path)) else None
            moves.append((tmp, path, old))  # before the move: a Ctrl-C during its system call is raised as it returns
            os.replace(tmp, path)
    except BaseException:
        whole = bool(staged) and not os.path.lexists(staged[-1][0])  # the last move made (a Ctrl-C as it returned)
        for tmp, path, old in [] if whole else reversed(moves):
            if os.path.lexists(tmp):
                continue  # (not moved)
            if old is None:
                os.remove(path)
            else:
                os.replace(old, path)
        raise
    finally:
        for leftover in [t for t, _ in staged] + kept:
            if os.path.lexists(leftover):
                os.remove(leftover)


def _keep_aside(path: Path, kept: list[str]) -> str:
    """A second name for ``path``'s file in its folder (a hard link; a copy where the file system has none), so that
    ``atomic_write_all`` can put the file back after replacing it; the name is added to ``kept`` first, for its
    caller to remove. A symbolic link is kept as the link, not as the file it names."""
    fd, aside = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.old.")
    os.close(fd)
    kept.append(aside)
    os.remove(aside)
    try:
        os.link(path, aside, follow_symlinks=False)
    except OSError:
        shutil.copy2(path, aside, follow_symlinks=False)
    return aside


def _holds(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bool:
    """Whether the safetensors file ``path`` already holds exactly ``tensors`` (dtypes included) and ``metadata``.

    safetensors writes its header's metadata in no fixed order, so saving the same weights twice gives different
    bytes; an unchanged file is left as it is, and its digest (what A/B journals key an adapter's results by)
    with it."""
    try:
        with safe_open(path, "pt") as f:
            if f.metadata() != metadata or set(f.keys()) != set(tensors):
                return False
            return all(
                (t := f.get_tensor(k)).dtype == tensors[k].dtype and torch.equal(t, tensors[k]) for k in tensors
            )
    except (OSError, SafetensorError):
        return False


class GateSet(nn.Module):
    """Base of gate adapters: one gate module per gated (full-attention) layer of a base model.

    Subclasses set ``kind`` (the ``config.json`` kind; the learned method that trains them, ``kvgates.methods``,
    names the policies that evict by them),
    ``captures`` (what the hooks must capture from the model: ``"hidden"`` = the normed hidden state entering
    attention, ``"qkv"`` = raw q/k/v projections) and build their modules from a ``GateConfig``;
    ``forward(layer_idx, captured)`` gives ``[B, T, H_kv]`` scores.
    """

    kind: ClassVar[str] = ""
    captures: ClassVar[str] = "hidden"
    default_hidden: ClassVar[int] = 512
    #: ``init_bias`` of fresh gates where none is given (``for_model``): TRIM-KV's retention bias (beta ~ 1: keep).
    default_init_bias: ClassVar[float] = 18.0
    #: Hub file patterns of what this kind keeps beside its config and weights (``load_parts`` reads it), fetched
    #: with them: nothing else in a repository is downloaded.
    parts: ClassVar[tuple[str, ...]] = ()
    #: The digest of the weights file these gates were loaded from, as read (not the file's bytes: an adapter
    #: saved again with another card or header order keeps it); None for gates not loaded (``for_model``). The A/B
    #: harness keys an adapter's results by it, whether it came from a folder, a shipped name or a Hub id.
    loaded_digest: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            GATE_KINDS[cls.kind] = cls

    def __init__(self, config: GateConfig):
        super().__init__()
        if config.kind != self.kind:
            raise AdapterError(f"{type(self).__name__} holds {self.kind!r} gates, the config says {config.kind!r}")
        self.config = config
        self._position = {layer: i for i, layer in enumerate(config.layer_ids)}

    # ------------------------------------------------------------------ building
    @classmethod
    def placeholder(cls) -> GateSet:
        """Untrained gates of this kind for no model, one layer of the smallest shapes: what checks a learned policy's
        parameters before any model loads (``train.py --check``, the benches' ``--policies``)."""
        return cls(GateConfig(kind=cls.kind, base_model="-", fingerprint="-", num_layers=1, layer_ids=[0], hidden_size=4,
                              num_attention_heads=1, num_kv_heads=1, head_dim=4, gate_hidden=1))

    @classmethod
    def for_model(
        cls,
        model: PreTrainedModel,
        gate_hidden: int | None = None,
        training_budget: int | None = None,
        init_bias: float | None = None,
    ) -> GateSet:
        """Freshly initialised gates shaped for ``model`` (recording its id and fingerprint); ``gate_hidden`` units
        (at least 1; None: the kind's default), the ``training_budget`` they are for (at least 1; None: not trained
        yet) and a finite ``init_bias`` (None: the kind's ``default_init_bias``)."""
        from kvgates.models import embedded_name_of, hub_id_of, model_fingerprint, require_model
        from kvgates.runtime.attention import input_device

        model = require_model(model)
        if not cls.kind:
            kinds = ", ".join(sorted(kind.__name__ for kind in GATE_KINDS.values()))
            raise TypeError(f"{cls.__name__} is the base of the gate kinds and makes no gates; call for_model on one of them ({kinds})")
        if init_bias is None:
            init_bias = cls.default_init_bias
        if gate_hidden is not None and (isinstance(gate_hidden, bool) or not isinstance(gate_hidden, int) or gate_hidden < 1):
            raise ValueError(f"gate_hidden must be a whole number of units, at least 1 (None: the default), got {gate_hidden!r}")
        if training_budget is not None and (isinstance(training_budget, bool) or not isinstance(training_budget, int) or training_budget < 1):
            raise ValueError(
                f"training_budget must be a whole number of tokens per KV head, at least 1 (None: not trained yet), got {training_budget!r}"
            )
        if isinstance(init_bias, bool) or not isinstance(init_bias, (int, float)) or not math.isfinite(init_bias):
            raise ValueError(f"init_bias must be a finite number, got {init_bias!r}")
        config = GateConfig(
            kind=cls.kind,
            base_model=hub_id_of(model),
            base_model_embedded=embedded_name_of(model),
            fingerprint=model_fingerprint(model),
            gate_hidden=cls.default_hidden if gate_hidden is None else gate_hidden,
            init_bias=init_bias,
            training_budget=training_budget,
            **_geometry(model),
        )
        return cls(config).to(device=input_device(model))

    def layer_position(self, layer_idx: int) -> int:
        if layer_idx not in self._position:
            raise AdapterError(f"layer {layer_idx} has no gate; this adapter gates layers {self.config.layer_ids}")
        return self._position[layer_idx]

    def forward(self, layer_idx: int, captured: Any) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def load_parts(self, folder: Path) -> None:
        """Read what this kind keeps in ``folder`` beside ``config.json`` and ``model.safetensors`` (and shape its
        modules by it) before the weights load; ``AdapterError`` (one sentence) for a missing or corrupt part.
        Default: a kind keeps nothing else."""

    def check_model(self, model: PreTrainedModel, strict: bool = True) -> None:
        """Refuse a model other than the one the gates were trained for (``strict=False``: same shapes suffice)."""
        from kvgates.models import hub_id_of, model_fingerprint

        diff = self._misfit(model)
        if diff:
            if model_fingerprint(model, self.config.version) == self.config.fingerprint:  # the very model: shapes edited
                raise AdapterError(
                    f"these gates name {self.config.base_model} as their model but their config does not fit it ({diff}); "
                    "the adapter's config.json is corrupt or was edited by hand"
                )
            raise AdapterError(
                f"these gates were trained for {self.config.base_model} and do not fit {hub_id_of(model)} ({diff})"
            )
        fingerprint = model_fingerprint(model, self.config.version)
        if strict and fingerprint != self.config.fingerprint:
            raise AdapterError(
                f"these gates were trained for {self.config.base_model} (fingerprint {self.config.fingerprint}), not for "
                f"this model {hub_id_of(model)} (fingerprint {fingerprint}); pass strict=False to attach them anyway"
            )

    def check_shapes(self, model: PreTrainedModel) -> None:
        """Refuse a model the gates' shapes do not fit (layers, heads, widths), reading only its config: what can be
        checked of a model whose weights have not loaded (``kvgates.models.model_skeleton``)."""
        from kvgates.models import hub_id_of

        diff = self._misfit(model)
        if diff:
            raise AdapterError(f"these gates were trained for {self.config.base_model} and do not fit {hub_id_of(model)} ({diff})")

    def _misfit(self, model: PreTrainedModel) -> str:
        """Where ``model``'s geometry differs from the gates' (``"num_layers 2 vs 30, ..."``), or ``""``; ``TypeError``
        for what is no transformers model (``check_model``, ``check_shapes``, and so a learned policy's ``attach``)."""
        from kvgates.models import require_model

        geometry = _geometry(require_model(model))
        mine = {k: getattr(self.config, k) for k in geometry}
        return ", ".join(f"{k} {mine[k]} vs {geometry[k]}" for k in geometry if geometry[k] != mine[k])

    # ------------------------------------------------------------------ saving and loading
    def save_pretrained(self, folder: str | os.PathLike) -> Path:
        """Write ``config.json``, ``model.safetensors`` and ``README.md`` to ``folder`` (created if needed; a leading
        ``~`` is the home folder; an adapter of the same kind there is replaced), every file written to a temporary one
        before any replaces its old one (``atomic_write_all``: an interrupted save leaves the old adapter whole); returns
        the folder. ``AdapterError`` (one sentence, nothing written) for an empty name, a file (or a path through one),
        a folder holding a model or any ``config.json`` that is not a gate adapter's (its config and weights would be
        overwritten), a folder holding an adapter of another kind, whose own parts (a DMS LoRA's ``lora/``) would stay,
        or a config JSON cannot hold (a numpy number in its results); ``TypeError`` for a ``folder`` that is neither a
        string nor a path."""
        if not isinstance(folder, (str, os.PathLike)):
            raise TypeError(f"folder must be a folder's path (a string or a path), got {type(folder).__name__}")
        if not str(folder).strip():  # Path("") is the current folder
            raise AdapterError("the folder name is empty; name the folder to save the adapter in")
        folder = output_path(folder)  # "~/gates" is the home folder's, not a folder named "~" in this one
        nearest = next(path for path in (folder, *folder.parents) if path.exists())  # (the folder, or where it would be made)
        if not nearest.is_dir():
            raise AdapterError(f"{nearest} is a file; name a folder to save the adapter in")
        there, other = _occupant(folder)
        if other is not None:
            raise AdapterError(f"{folder} holds {other}, which saving gates there would overwrite; save the adapter in another folder")
        if there is not None and there != self.kind:
            raise AdapterError(f"{folder} holds {there!r} gates; save these {self.kind!r} gates in another folder, or remove that one first")
        try:  # the texts before any file: a config that cannot be written leaves the adapter there whole
            text = json.dumps(self.config.to_dict(), indent=2)
        except (TypeError, ValueError) as err:
            raise AdapterError(
                f"the adapter's config cannot be written as JSON ({err}); its results and training must hold plain JSON "
                f"values (numbers, strings, booleans, null, lists, objects), and nothing was written to {folder}"
            ) from err
        card = self.model_card()
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in self.state_dict().items()}
        metadata = {"format": "pt", "kind": self.kind, "fingerprint": self.config.fingerprint}
        files = [(folder / CONFIG_FILE, lambda p: Path(p).write_text(text)), (folder / CARD_FILE, lambda p: Path(p).write_text(card))]
        if not _holds(folder / WEIGHTS_FILE, tensors, metadata):
            files.insert(0, (folder / WEIGHTS_FILE, lambda p: save_file(tensors, p, metadata=metadata)))
        atomic_write_all(files + self.part_files(folder))  # together: an interrupted save leaves the old adapter whole
        return folder

    def part_files(self, folder: Path) -> list[tuple[Path, Callable[[str], Any]]]:
        """The files of a kind's own parts (``load_parts``) that ``save_pretrained`` writes into ``folder`` with the
        adapter's, as ``(path, write)`` (``atomic_write_all``), their folders made; none by default."""
        return []

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | os.PathLike,
        revision: str | None = None,
        endpoint: str | None = None,
        token: str | None = None,
    ) -> GateSet:
        """Load an adapter from a local folder, the name of an adapter shipped with kvgates
        (``kvgates.gates.embedded``) or a Hub repository id (on the base class: any kind); ``TypeError`` for
        ``path_or_id`` that is neither a string nor a path, ``AdapterError`` (one sentence) for one that holds no adapter."""
        from kvgates.gates.embedded import embedded_adapter_dir

        if not isinstance(path_or_id, (str, os.PathLike)):
            raise TypeError(
                f"path_or_id must be an adapter folder, a shipped adapter's name or a Hub repository id (a string or a path), "
                f"got {type(path_or_id).__name__}"
            )
        if not str(path_or_id).strip():  # Path("") is the current folder
            raise AdapterError("the adapter name is empty; pass an adapter folder, a shipped adapter's name or a Hub repository id")
        folder = Path(os.path.expanduser(path_or_id))  # (a shipped name or a Hub id never begins with "~")
        if not folder.is_dir():
            folder = embedded_adapter_dir(str(path_or_id)) or _download(str(path_or_id), revision, endpoint, token)
        config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        if not config_path.is_file():
            raise AdapterError(f"{folder} has no {CONFIG_FILE}; a gate adapter folder holds {CONFIG_FILE}, {WEIGHTS_FILE} and {CARD_FILE}")
        config = _read_config(config_path)  # first: a model's folder is named as one, not as an adapter lacking files
        if not weights_path.is_file():
            raise AdapterError(f"{folder} has no {WEIGHTS_FILE}; a gate adapter folder holds {CONFIG_FILE}, {WEIGHTS_FILE} and {CARD_FILE}")
        target = GATE_KINDS[config.kind]
        if cls is not GateSet and not issubclass(target, cls):
            raise AdapterError(f"{folder} holds {config.kind!r} gates, not {cls.kind!r} gates")
        try:
            tensors = load_file(str(weights_path))
        except (SafetensorError, OSError, ValueError) as err:
            raise AdapterError(f"{weights_path} is truncated or corrupt ({err})") from err
        with torch.device("meta"):  # shapes only, no memory: a corrupt size (gate_hidden 10**12) is refused, not allocated
            gates = target(config)
            gates.load_parts(folder)
        expected = gates.state_dict()
        missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        if missing or unexpected:
            raise AdapterError(
                f"{weights_path} does not match its config: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
            )
        for name, tensor in tensors.items():
            if tensor.shape != expected[name].shape:
                raise AdapterError(f"{weights_path}: {name} has shape {tuple(tensor.shape)}, the config implies {tuple(expected[name].shape)}")
        gates.to_empty(device="cpu").load_state_dict(tensors)
        gates.loaded_digest = _tensors_digest(tensors)
        stored = {t.dtype for t in tensors.values() if t.is_floating_point()}
        if len(stored) == 1:  # in the precision it was saved in (shipped adapters: float16), so it saves back the same
            gates.to(stored.pop())
        return gates

    def push_to_hub(
        self,
        repo_id: str,
        private: bool = False,
        token: str | None = None,
        endpoint: str | None = None,
        commit_message: str = "Upload kvgates gate adapter",
    ) -> str:
        """Create (if needed) the Hub model repository ``repo_id`` and upload the adapter; returns the commit URL.
        ``HubPushError`` (a ``ConnectionError``, one sentence) when the Hub cannot be reached or refuses the upload."""
        from huggingface_hub import HfApi
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(repo_id)
        except HFValidationError as err:  # not the network's fault: HubPushError would send the user to check it
            raise ValueError(f"{repo_id!r} is not a Hub repository id ({str(err).splitlines()[0]}); name one as 'user/name'") from None
        api = HfApi(endpoint=endpoint, token=token)
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            try:
                api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
                info = api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message, repo_type="model")
            except Exception as err:  # the Hub client raises many types (offline mode, no network, auth, HTTP errors)
                raise HubPushError(repo_id, str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__) from err
        return str(getattr(info, "commit_url", info))

    def model_card(self) -> str:
        """The adapter's ``README.md``: front matter for the Hub, what the gates are for, usage, results, recipe."""
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        from kvgates.methods import method_of

        c = self.config
        method = method_of(self)
        policy = method.policy
        # Linear gates (DMS's decision heads, KVzap's linear regressors) have no hidden layer: their config records a
        # gate_hidden they never read.
        width = f"gate width {c.gate_hidden}" if "hidden" in method.gate_keys else "linear gates (no hidden layer)"
        results = "\n".join(f"| {k} | {v} |" for k, v in c.results.items()) or "| (none recorded yet) | |"
        validated = (
            "The training run's last evaluation, on the validation split (recipes are chosen on it; the test split is the\n"
            "held-out comparison's), at the training budget:\n\n"
        ) if c.results else ""
        report = f"\n{c.report.strip()}\n" if c.report.strip() else ""
        training = ""
        if c.training:
            recipe = json.dumps(c.training, indent=1, sort_keys=True)
            training = f"\n## Training\n\n```json\n{recipe}\n```\n"
        embedded = f" (kvgates ships it as `{c.base_model_embedded}`: it loads offline)" if c.base_model_embedded else ""
        # A model loaded from a folder is named local:<folder name> (no path on the author's disk), which load_model
        # does not take: the usage names the folder to pass instead.
        # The policy settings the run trained and validated with (its recipe's policy section: DMS's window must be
        # training's), which make_policy's defaults would otherwise replace.
        trained_with = (c.training.get("recipe") or {}).get("policy") or {}
        settings = "".join(f", {key}={value!r}" for key, value in trained_with.items())
        load = c.base_model
        if load.startswith("local:"):
            load = f"<the folder of {load.removeprefix('local:')}, the base model>"
        try:  # the Hub refuses a card whose base_model is no model id (local:<folder>): the upload would fail
            validate_repo_id(c.base_model)
            base_model = f"base_model: {c.base_model}\n"
        except HFValidationError:
            base_model = ""
        return f"""---
library_name: kvgates
{base_model}tags: [kvgates, kv-cache, kv-cache-eviction, {c.kind}]
---

# kvgates {c.kind} gates for {c.base_model}

Learned KV-cache eviction modules ({c.kind}) for `{c.base_model}`{embedded} (fingerprint `{c.fingerprint}`): one gate per
gated layer ({len(c.layer_ids)} of {c.num_layers}), {c.num_kv_heads} KV heads, {width}.
Training budget: {c.training_budget if c.training_budget is not None else "not trained yet"}.
Training data: {c.training_data or "none recorded"}.

## Usage

```python
import kvgates
model, tok = kvgates.load_model("{load}")
policy = kvgates.make_policy("{policy}", budget={c.training_budget or 256}, gates="<this repo id or folder>"{settings})
policy.attach(model)
cache = kvgates.BudgetCache(model.config, policy)
out = model.generate(**tok("...", return_tensors="pt"), past_key_values=cache, max_new_tokens=64)
```

## Results

{validated}| metric | value |
|---|---|
{results}
{report}{training}"""


def _read_config(path: Path, source: str | None = None) -> GateConfig:
    """The adapter config in the file ``path`` (named ``source`` in errors; default: the path), checked
    (``GateConfig.from_dict``); ``AdapterError`` for a file that is no JSON."""
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterError(f"{source or path} is not valid JSON ({err}); the file is corrupt or truncated") from err
    return GateConfig.from_dict(raw, source or str(path))


def _occupant(folder: Path) -> tuple[str | None, str | None]:
    """What ``folder``'s ``config.json`` belongs to: ``(kind, None)`` for a gate adapter's (its ``kind`` and
    ``base_model``), ``(None, what)`` for another's (a model's: ``"a llama model (...)"``; unreadable, or no JSON), and
    ``(None, None)`` where the folder holds none."""
    try:
        data = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError):  # unreadable, or no JSON (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        return None, f"a {CONFIG_FILE} that is not a kvgates gate adapter's"
    if isinstance(data, dict) and "kind" in data and "base_model" in data:
        return data["kind"], None
    if isinstance(data, dict) and ("model_type" in data or "architectures" in data):
        return None, f"a {data.get('model_type') or 'transformers'} model (its {CONFIG_FILE} and weights)"
    return None, f"a {CONFIG_FILE} that is not a kvgates gate adapter's"


def _shipped_names() -> str:
    """The shipped adapters' names, for an error that says what else loads offline."""
    from kvgates.gates.embedded import embedded_adapters

    return ", ".join(embedded_adapters()) or "none"


def _download(repo_id: str, revision: str | None, endpoint: str | None, token: str | None) -> Path:
    """The Hub adapter ``repo_id`` in the local Hub cache: its ``config.json`` first, checked (a model's repository
    is refused before any of its weights download), then the files its kind holds, nothing else."""
    import huggingface_hub.constants
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise AdapterError(
            f"{repo_id} is neither an adapter folder nor a Hub repository id; pass an existing adapter folder "
            f"(config.json, model.safetensors), a shipped adapter's name ({_shipped_names()}) or an id like 'user/name'"
        ) from None
    where = dict(repo_id=repo_id, revision=revision, endpoint=endpoint, token=token)
    if not isinstance(try_to_load_from_cache(repo_id, CONFIG_FILE, revision=revision), str):
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            raise _not_fetched(repo_id, "it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
        # Not cached: the download would retry an unreachable Hub for half a minute, saying so on stderr; ask once.
        try:
            HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision, timeout=10)
        except HfHubHTTPError:
            pass  # the Hub answered: the download says what it wants (no such repository, a token)
        except Exception as err:  # no network, no DNS, timeout
            raise _not_fetched(repo_id, f"the Hub cannot be reached ({type(err).__name__})") from None
    kind = _read_config(_fetch(hf_hub_download, filename=CONFIG_FILE, **where), f"{repo_id}/{CONFIG_FILE}").kind
    return _fetch(snapshot_download, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE, CARD_FILE, *GATE_KINDS[kind].parts], **where)


def _fetch(download: Callable[..., str], repo_id: str, **kwargs: Any) -> Path:
    """``download(repo_id=repo_id, **kwargs)`` (a Hub client download) as a path; ``AdapterError`` where it fails."""
    try:
        return Path(download(repo_id=repo_id, **kwargs))
    except Exception as err:  # the Hub client raises many types (offline, 404, auth)
        raise _not_fetched(repo_id, f"it could not be fetched from the Hub ({type(err).__name__})") from err


def _not_fetched(repo_id: str, why: str) -> AdapterError:
    """The refusal of a Hub adapter id that did not load, ``why`` saying what the Hub did."""
    return AdapterError(
        f"no local folder {repo_id!r} and {why}; pass an existing adapter folder, a shipped adapter's name "
        f"({_shipped_names()}) or a reachable Hub repository id"
    )


def load_gates(path_or_id: str | os.PathLike, **kwargs: Any) -> GateSet:
    """Load a gate adapter of any kind from a folder, a shipped adapter's name or a Hub id."""
    return GateSet.from_pretrained(path_or_id, **kwargs)


def _tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """Digest of gate tensors: their names, dtypes, shapes and values (``GateSet.loaded_digest``)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class RetentionGates(GateSet):
    """TRIM-KV retention gates, one ``RetentionGate`` per gated layer; scores are ``log beta`` (<= 0)."""

    kind = "retention"
    captures = "hidden"

    def __init__(self, config: GateConfig):
        super().__init__(config)
        self.gates = nn.ModuleList(
            RetentionGate(config.hidden_size, config.num_kv_heads, config.gate_hidden, config.activation, config.init_bias)
            for _ in config.layer_ids
        )

    def forward(self, layer_idx: int, captured: torch.Tensor) -> torch.Tensor:
        gate = self.gates[self.layer_position(layer_idx)]
        return gate(captured.to(gate.up.weight.dtype))


class GlobalRetentionGates(GateSet):
    """DBTrimKV global retention gates: per-layer trunks and one final projection + bias shared by all layers,
    so ``log beta`` is comparable across layers and heads (a single global budget)."""

    kind = "retention-global"
    captures = "hidden"

    def __init__(self, config: GateConfig):
        super().__init__(config)
        self.trunks = nn.ModuleList(
            GlobalRetentionTrunk(config.hidden_size, config.gate_hidden, config.activation) for _ in config.layer_ids
        )
        self.shared = SharedRetentionHead(config.num_kv_heads, config.gate_hidden, config.init_bias)

    def forward(self, layer_idx: int, captured: torch.Tensor) -> torch.Tensor:
        trunk = self.trunks[self.layer_position(layer_idx)]
        return self.shared(trunk(captured.to(trunk.up.weight.dtype)))


class RetainingHeads(GateSet):
    """Locret retaining heads, one ``RetainingHead`` per gated layer over ``concat[q, k, v]``."""

    kind = "retaining-head"
    captures = "qkv"
    default_hidden = 1024

    def __init__(self, config: GateConfig):
        super().__init__(config)
        width = (config.num_attention_heads + 2 * config.num_kv_heads) * config.head_dim
        self.heads = nn.ModuleList(
            RetainingHead(width, config.num_kv_heads, config.gate_hidden, config.activation) for _ in config.layer_ids
        )

    def forward(self, layer_idx: int, captured: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        head = self.heads[self.layer_position(layer_idx)]
        qkv = torch.cat(captured, dim=-1) if isinstance(captured, tuple) else captured
        return head(qkv.to(head.up.weight.dtype))
