"""Draft-head training: `python -m speculative.train` (see `speculative/train/cli.py`)."""
