"""Draft-head training: `python -m specserve.speculative.train` (see
`specserve/speculative/train/cli.py`)."""
