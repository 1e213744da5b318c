"""specserve: an LLM serving runtime built around lossless speculative decoding.

Rooms: `specserve.launch` (server args, processes), `specserve.speculative` (drafters, worker,
controller, trainers), `specserve.runtime` (the serving machinery), `specserve.corpora` (data),
`specserve.kernels` (ops and the CPU engine).
"""

import os as _os

# torch's OpenMP workers spin after each parallel op by default, on the very cores the CPU
# engine's own threads need (measured: a 0.3 ms matmul took 4 ms, one scheduler tick). Passive
# waiting must be chosen before torch loads; every room of ours imports this package first.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _os.environ["SPECSERVE_SET_OMP_WAIT_POLICY"] = "1"  # peers we launch get it removed
