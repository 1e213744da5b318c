"""One module per speculative algorithm (each registers itself with `register_algorithm`)."""

from pathlib import Path

# the heads and drafts trained for the default model, shipped at the repository's root
ASSETS = Path(__file__).resolve().parents[3] / "assets"
