"""Weights of a Hugging Face model directory, one tensor at a time.

safetensors files are opened memory-mapped, so iterating never holds more than one tensor copy.
Legacy `.bin` checkpoints are read only with `torch.load(weights_only=True)`, which refuses
anything but tensors and plain containers: we never run arbitrary unpickling.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.runtime.errors import ModelLoadError

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files of `model_dir`, safetensors preferred, in a stable order."""
    path = Path(model_dir)
    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        index = path / index_name
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (OSError, KeyError, json.JSONDecodeError) as exc:
                raise ModelLoadError(f"{index}: unreadable shard index: {exc}") from exc
            files = [path / name for name in sorted(set(weight_map.values()))]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise ModelLoadError(f"{index} names missing shards: {', '.join(missing)}")
            return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    # Mistral-format "consolidated.safetensors" duplicates the HF weights under other names.
    shards = sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if shards:
        return shards
    if (path / "pytorch_model.bin").is_file():
        return [path / "pytorch_model.bin"]
    raise ModelLoadError(
        f"{path}: no weights found (expected model.safetensors, {SAFETENSORS_INDEX}, "
        f"or pytorch_model.bin)"
    )


def iter_safetensors_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every tensor of the checkpoint in `model_dir`.

    Tensors come out on CPU in their stored dtype; a name appears exactly once.
    """
    for file in weight_files(model_dir):
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    yield name, reader.get_tensor(name)
        else:
            yield from _iter_bin(file)


def _iter_bin(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any failure here means "not a plain tensor file"
        raise ModelLoadError(
            f"{file}: cannot load with torch.load(weights_only=True): {exc}"
        ) from exc
    if not isinstance(state, dict):
        raise ModelLoadError(f"{file}: expected a state dict, found {type(state).__name__}")
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ModelLoadError(f"{file}: entry {name!r} is not a tensor")
        yield name, tensor
