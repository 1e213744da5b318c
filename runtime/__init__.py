"""specserve runtime. `from runtime import Engine` gives the serving system without HTTP (plain
decoding; `from launch import Engine` takes the speculative options too)."""

import os as _os

# torch's OpenMP workers spin after each parallel op by default, on the very cores the CPU
# engine's own threads need (measured: a 0.3 ms matmul took 4 ms, one scheduler tick). Passive
# waiting must be chosen before torch loads, so every package of ours sets it on import.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _os.environ["SPECSERVE_SET_OMP_WAIT_POLICY"] = "1"  # peers we launch get it removed


def __getattr__(name: str):
    if name == "Engine":  # lazy: importing runtime.* submodules must not start torch-heavy code
        from runtime.engine import Engine

        return Engine
    raise AttributeError(name)
