"""Speculative decoding: draft trees, verification, and the registered algorithms.

Each algorithm is one module under `specserve/speculative/drafters/` (imported here, which registers
it); an algorithm outside this package registers by naming its module in the environment variable
SPECSERVE_PLUGINS (comma-separated module names), which every process imports with this package.
"""

import importlib as _importlib
import os as _os

from specserve.speculative.drafters import (  # noqa: F401 - each registers its algorithm(s)
    eagle,
    early_exit,
    jump_forward,
    lookahead,
    medusa,
    mlp_speculator,
    ngram,
    standalone,
    suffix,
)

for _name in filter(None, (m.strip() for m in _os.environ.get("SPECSERVE_PLUGINS", "").split(","))):
    _importlib.import_module(_name)
