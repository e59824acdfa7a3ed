"""Strict safetensors checkpoint loading (and writing, for synthetic test checkpoints).

The model is built on the meta device and each tensor is read with `safe_open` straight onto the target
device, cast to the target dtype and assigned as the parameter: no second full copy of the weights ever
exists. Every checkpoint key must match a parameter name and shape exactly (no pickle, no tied weights).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from runtime.config import ModelConfig
from runtime.device_memory import indexed_cuda_device
from runtime.model import MossSpeechForCausalLM, build_meta_model, set_parameter
from runtime.tokenizer import Tokenizer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHOWN_KEYS = 5
# stored types that are cast to the load dtype; anything else (integers, bools, FP8 codes without their
# scales) would load as wrong values
FLOAT_DTYPES = ("BF16", "F16", "F32")


class CheckpointError(ValueError):
    """A checkpoint folder is incomplete or does not match the model its config.json describes."""


def _few(keys: Iterable[str]) -> str:
    ordered = sorted(keys)
    shown = ", ".join(ordered[:_SHOWN_KEYS])
    more = f", ... ({len(ordered)} in all)" if len(ordered) > _SHOWN_KEYS else f" ({len(ordered)} in all)"
    return shown + more


def _checkpoint_files(path: Path) -> dict[str, list[str]]:
    """Map each safetensors file of the checkpoint to the keys it holds (checked against the index)."""
    index_path = path / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_weight_map(index_path)
        file_names = sorted(set(weight_map.values()))
    elif (path / SINGLE_FILE).is_file():
        weight_map, file_names = {}, [SINGLE_FILE]
    else:
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    files: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    for name in file_names:
        file_path = path / name
        if not file_path.is_file():
            raise CheckpointError(f"checkpoint file {name} listed in {INDEX_FILE} is missing from {path}")
        with _open(file_path) as f:
            keys = list(f.keys())
        duplicated = [f"{k} ({owner[k]} and {name})" for k in keys if k in owner]
        if duplicated:
            raise CheckpointError(f"{path}: keys stored in more than one file: {_few(duplicated)}")
        owner.update({k: name for k in keys})
        files[name] = keys
    if weight_map:
        misplaced = [k for k, name in weight_map.items() if owner.get(k) != name]
        unlisted = [k for k in owner if k not in weight_map]
        if misplaced or unlisted:
            raise CheckpointError(
                f"{INDEX_FILE} disagrees with the files: listed but not found where the index says: "
                f"{_few(misplaced) if misplaced else 'none'}; stored but not listed: "
                f"{_few(unlisted) if unlisted else 'none'}"
            )
    return files


def _read_weight_map(index_path: Path) -> dict[str, str]:
    """The index's tensor -> file map; each file a plain name inside the checkpoint folder."""
    try:
        with index_path.open(encoding="utf-8") as f:
            index = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index_path} is not valid JSON: {exc}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not weight_map:
        raise CheckpointError(f"{index_path} has no weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{index_path}: weight_map must map tensor names to file names")
    for name in sorted(set(weight_map.values())):
        # (a check of the name, not of the resolved path: a Hugging Face cache snapshot holds symlinks into
        # its blob store, outside the folder)
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise CheckpointError(f"{index_path} names {name!r}: shard files must be plain names in the folder")
    return weight_map


def _open(file_path: Path, **kwargs: str) -> Any:
    """`safe_open`, a file that is not valid safetensors (truncated, say) a CheckpointError naming it."""
    try:
        return safe_open(str(file_path), framework="pt", **kwargs)
    except SafetensorError as exc:
        raise CheckpointError(f"{file_path} is not a readable safetensors file: {exc}") from None


def _safetensors_device(device: torch.device) -> str:
    return str(indexed_cuda_device(device) if device.type == "cuda" else device)


def load_pretrained(
    path: str | Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    debug_checks: bool = False,
    progress: bool = True,
    mapped: bool = False,
) -> tuple[MossSpeechForCausalLM, Tokenizer]:
    """Load `config.json`, `tokenizer.json` and the safetensors weights (single file or sharded) of a
    checkpoint folder; any missing, unexpected or wrongly shaped tensor is a `CheckpointError`.

    `mapped` (CPU only): tensors stored in `dtype` stay views of the files' mappings instead of
    copies, so they sit in the page cache, which the system can reclaim, and not in the process's own memory.
    For a model that is consumed right away (FP8 staging: each matrix is quantized onto the GPU and dropped)
    while the files stay as they are: a file truncated meanwhile would fault the process (SIGBUS)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder not found: {path}")
    config = ModelConfig.from_pretrained_dir(path)
    tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    model = build_meta_model(config, debug_checks=debug_checks)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    files = _checkpoint_files(path)
    stored = {k for keys in files.values() for k in keys}
    missing, unexpected = expected.keys() - stored, stored - expected.keys()
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys: {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_few(unexpected)}")
        raise CheckpointError(f"checkpoint {path} does not match the model: " + "; ".join(parts))

    device = torch.device(device)
    if mapped and device.type != "cpu":
        raise ValueError(f"mapped loading keeps the tensors in the files' mappings, on the CPU; device is {device}")
    mismatched: list[str] = []
    wrong_types: list[str] = []
    for name, keys in files.items():
        with _open(path / name) as f:
            for key in keys:
                stored_slice = f.get_slice(key)
                shape = tuple(stored_slice.get_shape())
                if shape != expected[key]:
                    mismatched.append(f"{key} in {name}: checkpoint {list(shape)} vs model {list(expected[key])}")
                if stored_slice.get_dtype() not in FLOAT_DTYPES:
                    wrong_types.append(f"{key} in {name}: {stored_slice.get_dtype()}")
    if mismatched:
        raise CheckpointError(f"{path}: wrong tensor shapes ({len(mismatched)}): " + "; ".join(sorted(mismatched)[:5]))
    if wrong_types:
        raise CheckpointError(f"{path}: tensors of a type other than {', '.join(FLOAT_DTYPES)} ({len(wrong_types)}): "
                              + "; ".join(sorted(wrong_types)[:5]))

    with tqdm(total=len(expected), desc="loading weights", unit="tensor", disable=not progress) as bar:
        for name, keys in files.items():
            with _open(path / name, device=_safetensors_device(device)) as f:
                for key in keys:
                    tensor = f.get_tensor(key)
                    if tensor.dtype != dtype:
                        tensor = tensor.to(dtype)
                    elif tensor.device.type == "cpu" and not mapped:
                        # a view of the file's mapping: the model would change with the file, or fault
                        # (SIGBUS) once it is truncated
                        tensor = tensor.clone()
                    set_parameter(model, key, tensor)
                    bar.update(1)
    still_meta = [name for name, p in model.named_parameters() if p.is_meta]
    assert not still_meta, still_meta
    return model.eval(), tokenizer


def _split_into_shards(names: list[str], sizes: list[int], num_shards: int) -> list[list[str]]:
    """Consecutive groups of roughly equal byte size, none empty."""
    total = sum(sizes)
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    acc, previous = 0, -1
    for i, (name, size) in enumerate(zip(names, sizes)):
        shard = min(num_shards - 1, acc * num_shards // max(total, 1))
        shard = max(shard, num_shards - (len(names) - i))  # leave at least one tensor for each later shard
        shard = min(shard, previous + 1)  # and never skip a shard
        shards[shard].append(name)
        acc, previous = acc + size, shard
    assert all(shards), [len(s) for s in shards]
    return shards


def save_checkpoint(
    model: MossSpeechForCausalLM,
    path: str | Path,
    *,
    num_shards: int = 1,
    tokenizer: Tokenizer | None = None,
) -> None:
    """Write config.json, safetensors weights (+ index when `num_shards` > 1) and tokenizer.json
    (the tiny tokenizer unless one is given) in the layout `load_pretrained` reads."""
    path = Path(path)
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    if not 1 <= num_shards <= len(state):
        raise CheckpointError(f"num_shards must lie in [1, {len(state)}], got {num_shards}")
    path.mkdir(parents=True, exist_ok=True)
    with (path / "config.json").open("w", encoding="utf-8") as f:
        json.dump(model.config.to_hf_dict(), f, indent=2)
    (tokenizer or Tokenizer.tiny()).save(path / "tokenizer.json")
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(state, str(path / SINGLE_FILE), metadata=metadata)
        return
    names = list(state)
    sizes = [state[n].numel() * state[n].element_size() for n in names]
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(_split_into_shards(names, sizes, num_shards)):
        file_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: state[n] for n in shard}, str(path / file_name), metadata=metadata)
        weight_map.update({n: file_name for n in shard})
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    with (path / INDEX_FILE).open("w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
