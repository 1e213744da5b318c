"""specserve runtime. `from specserve.runtime import Engine` gives the serving system without HTTP
(plain decoding; `from specserve.launch import Engine` takes the speculative options too)."""



def __getattr__(name: str):
    if name == "Engine":  # lazy: importing runtime.* submodules must not start torch-heavy code
        from specserve.runtime.engine import Engine

        return Engine
    raise AttributeError(name)
