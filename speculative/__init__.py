"""Speculative decoding: draft trees, verification, and the registered algorithms."""

from speculative import eagle, ngram  # noqa: F401 - registers EAGLE, EAGLE3, NGRAM
