"""Shared test helpers (tiny random models, GGUF writers)."""
