"""Launching the server: arguments, processes, readiness. `from specserve.launch import Engine`
gives the serving system without HTTP, speculative decoding included."""



def __getattr__(name: str):
    if name == "Engine":  # lazy: importing launch.* submodules must not start torch-heavy code
        from specserve.launch.engine import Engine

        return Engine
    raise AttributeError(name)
