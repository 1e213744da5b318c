"""Speculative decoding: draft trees, verification, and the registered algorithms."""

from speculative import ngram  # noqa: F401 - registers NGRAM
