"""specserve runtime. `from runtime import Engine` gives the serving system without HTTP."""


def __getattr__(name: str):
    if name == "Engine":  # lazy: importing runtime.* submodules must not start torch-heavy code
        from runtime.engine import Engine

        return Engine
    raise AttributeError(name)
