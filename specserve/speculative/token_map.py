"""`--speculative-token-map`: a reduced draft vocabulary ("hot tokens") for EAGLE-1/2 heads.

An EAGLE-1/2 head scores every target token through the target's LM head; with a token map it
scores only the listed ids (the LM-head rows are sliced once at load), which makes every draft
step's LM-head matmul `len(map) / vocab` as costly. Drafts are mapped back to target ids, so
trees and verification only ever see target ids: output is unchanged, only acceptance can drop
when the continuation leaves the map.

Formats (read without unpickling arbitrary objects):
- `.safetensors`: one 1-D integer tensor, under any key;
- `.json`: a list of ints, or `{"token_ids": [...]}`;
- `.npy`: a 1-D integer array (`numpy.load(allow_pickle=False)`);
- `.pt` (SGLang publishes its maps so): a 1-D integer tensor or a list of ints, read with
  `torch.load(weights_only=True)` only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOKEN_MAP_SUFFIXES = (".safetensors", ".json", ".npy", ".pt")


def check_token_map_path(path: str) -> None:
    """Cheap start-up checks (the file exists, its format is known) before any model loads."""
    p = Path(path)
    if p.suffix.lower() not in TOKEN_MAP_SUFFIXES:
        raise ValueError(f"--speculative-token-map {path}: unknown format {p.suffix!r}; "
                         f"expected one of {TOKEN_MAP_SUFFIXES}")
    if not p.is_file():
        raise ValueError(f"--speculative-token-map {path}: no such file")


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The map's target token ids, sorted and unique: int64 [n] on the CPU."""
    path = Path(path)
    check_token_map_path(str(path))
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        raw = _read_safetensors(path)
    elif suffix == ".json":
        raw = _read_json(path)
    elif suffix == ".npy":
        raw = _read_npy(path)
    else:
        raw = _read_pt(path)
    return _validate(raw, path, vocab_size)


def _read_safetensors(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    if len(tensors) != 1:
        raise ValueError(f"token map {path}: expected one tensor, found {len(tensors)} "
                         f"({sorted(tensors)[:5]})")
    return next(iter(tensors.values()))


def _read_json(path: Path) -> torch.Tensor:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"token map {path}: not valid JSON ({e})") from e
    if isinstance(data, dict):
        if "token_ids" not in data:
            raise ValueError(f"token map {path}: a JSON object needs a 'token_ids' list")
        data = data["token_ids"]
    return _from_list(data, path)


def _read_npy(path: Path) -> torch.Tensor:
    import numpy as np

    try:
        arr = np.load(path, allow_pickle=False)
    except ValueError as e:  # object arrays need pickle: refused
        raise ValueError(f"token map {path}: not a plain numeric .npy array ({e})") from e
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"token map {path}: expected a .npy array, not an archive")
    if arr.dtype.kind not in "iub":
        raise ValueError(f"token map {path}: token ids must be integers, got dtype {arr.dtype}")
    return torch.from_numpy(arr.astype(np.int64))


def _read_pt(path: Path) -> torch.Tensor:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses pickled objects other than tensors/containers
        raise ValueError(f"token map {path}: cannot be read with torch.load(weights_only=True) "
                         f"({e})") from e
    if isinstance(data, torch.Tensor):
        return data
    return _from_list(data, path)


def _from_list(data: object, path: Path) -> torch.Tensor:
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"token map {path}: expected a list of token ids, got "
                         f"{type(data).__name__}")
    if any(isinstance(x, (list, tuple)) for x in data):
        raise ValueError(f"token map {path}: expected a 1-D list of token ids, got nested lists")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        raise ValueError(f"token map {path}: token ids must be integers")
    return torch.tensor(list(data), dtype=torch.int64)


def _validate(ids: torch.Tensor, path: Path, vocab_size: int) -> torch.Tensor:
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"token map {path}: token ids must be integers, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"token map {path}: expected a 1-D list of token ids, got shape "
                         f"{tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"token map {path}: empty")
    ids = ids.to(torch.int64)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token map {path}: token id {bad} is outside the target vocabulary "
                         f"[0, {vocab_size})")
    return torch.unique(ids)  # sorted
