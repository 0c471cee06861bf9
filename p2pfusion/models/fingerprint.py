"""A model's swarm key: its architecture and a digest of its weights.

Peers and clients meet under this key, so it must be the same for the same weights whatever the
files are called or how they are sharded, and differ for any other weights. So tensors are hashed
from the safetensors files that stages load: each tensor's name, dtype, shape and raw bytes
(safetensors stores them little-endian and contiguous, so the bytes are canonical), combined in
order of tensor name. Reading every weight takes a while, so each file's tensor digests are
cached (under `cache_root()/digests` as models/source.py calls it), keyed by the file's resolved
path and stamped with its size and mtime.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from tqdm import tqdm

from p2pfusion.errors import ModelError

log = logging.getLogger(__name__)

DIGEST_HEX = 16  # 64 bits of the weights' digest in the key: enough to tell models apart
CHUNK = 8 << 20
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header

# one tensor: name -> (dtype, shape, sha256 of its bytes)
TensorDigests = dict[str, tuple[str, list[int], str]]


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files a model's weights are read from (the index's shards when there is one)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(f"unreadable weight index {index}: {exc}") from exc
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no safetensors weights in {folder}")
    return files


def swarm_key(folder: Path, cache: Path) -> str:
    """`<model_type>-<layers>x<hidden>-<digest>`: readable, and the same only for the same weights.

    The architecture fields that decide how layers are split are in the key, so a key never
    matches a model that peers would split differently even if the digest prefix collided."""
    try:
        config = json.loads((folder / "config.json").read_text())
        family, layers, hidden = config["model_type"], config["num_hidden_layers"], config["hidden_size"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"cannot read the architecture in {folder / 'config.json'}: {exc}") from exc
    if not isinstance(family, str) or type(layers) is not int or type(hidden) is not int:
        raise ModelError(f"invalid model_type, num_hidden_layers or hidden_size in {folder / 'config.json'}")
    safe_family = "".join(c if c.isalnum() or c == "_" else "_" for c in family)
    return f"{safe_family}-{layers}x{hidden}-{weights_digest(folder, cache)[:DIGEST_HEX]}"


def weights_digest(folder: Path, cache: Path) -> str:
    """sha256 over every tensor (name, dtype, shape, digest of its bytes), in order of tensor name."""
    files = [(path, *_stamp(path, cache)) for path in weight_files(folder)]
    parts = [_load_cached(entry, stamp) for _, entry, stamp, _ in files]
    missing = [i for i, part in enumerate(parts) if part is None]
    if missing:
        log.info("hashing the weights in %s once (cached in %s)", folder, cache)
        with tqdm(total=sum(files[i][3] for i in missing), desc="hashing weights", unit="B", unit_scale=True,
                  leave=False, file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
            for i in missing:
                path, entry, stamp, _ = files[i]
                parts[i] = _hash_file(path, bar)
                _save_cached(entry, stamp, parts[i])
    tensors: TensorDigests = {}
    for part in parts:  # in file order, so a tensor found twice counts as the loader reads it: the last
        tensors.update(part)
    whole = hashlib.sha256(b"p2pfusion weights v1\n")
    for name in sorted(tensors):
        dtype, shape, digest = tensors[name]
        whole.update(json.dumps([name, dtype, shape, digest]).encode() + b"\n")
    return whole.hexdigest()


def _hash_file(path: Path, bar: tqdm) -> TensorDigests:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= min(MAX_HEADER, size - 8):
                raise ModelError(f"not a safetensors file: {path}")
            header = json.loads(f.read(length))
            header.pop("__metadata__", None)
            base = 8 + length
            entries = [(name, _entry(name, info, size - base, path)) for name, info in header.items()]
            bar.update(base)
            buffer = bytearray(CHUNK)
            digests: TensorDigests = {}
            for name, (dtype, shape, begin, end) in sorted(entries, key=lambda e: e[1][2]):
                f.seek(base + begin)
                tensor = hashlib.sha256()
                left = end - begin
                while left:
                    read = f.readinto(memoryview(buffer)[: min(left, CHUNK)])
                    if not read:
                        raise ModelError(f"truncated safetensors file: {path}")
                    tensor.update(memoryview(buffer)[:read])
                    left -= read
                    bar.update(read)
                digests[name] = (dtype, shape, tensor.hexdigest())
    except OSError as exc:
        raise ModelError(f"cannot read weights {path}: {exc.strerror or exc}") from exc
    except (ValueError, TypeError, AttributeError) as exc:  # a header that is not a JSON object
        raise ModelError(f"not a safetensors file: {path}") from exc
    return digests


def _entry(name: str, info, data_size: int, path: Path) -> tuple[str, list[int], int, int]:
    try:
        dtype, shape, (begin, end) = str(info["dtype"]), [int(d) for d in info["shape"]], info["data_offsets"]
        begin, end = int(begin), int(end)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"malformed safetensors header in {path} (tensor {name})") from exc
    if not 0 <= begin <= end <= data_size:
        raise ModelError(f"tensor {name} lies outside the data of {path}")
    return dtype, shape, begin, end


def _stamp(path: Path, cache: Path) -> tuple[Path, str, int]:
    """Where `path`'s digests are cached (one entry per resolved path, so a changed file replaces
    its entry), the stamp (resolved path, size, mtime) the entry must carry, and the file's size."""
    try:
        resolved = path.resolve()
        stat = resolved.stat()
    except OSError as exc:
        raise ModelError(f"cannot read weights {path}: {exc.strerror or exc}") from exc
    stamp = f"{resolved}:{stat.st_size}:{stat.st_mtime_ns}"
    return cache / f"{hashlib.sha256(str(resolved).encode()).hexdigest()[:32]}.json", stamp, stat.st_size


def _load_cached(entry: Path, stamp: str) -> TensorDigests | None:
    try:
        saved = json.loads(entry.read_text())
        if saved["stamp"] != stamp:
            return None
        return {str(name): (str(d), [int(x) for x in s], str(h)) for name, (d, s, h) in saved["tensors"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # absent or damaged: computed again
        return None


def _save_cached(entry: Path, stamp: str, digests: TensorDigests) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"stamp": stamp, "tensors": digests}))
        tmp.replace(entry)
    except OSError as exc:  # a read-only cache costs only time
        log.warning("cannot cache the weights' digest in %s: %s", entry.parent, exc)
