"""Speculative decoding: draft trees, verification, and the registered algorithms."""

import runtime  # noqa: F401 - first: sets the OpenMP wait policy before torch loads
from speculative import eagle, ngram  # noqa: F401 - registers EAGLE, EAGLE3, NGRAM
