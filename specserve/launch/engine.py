"""`Engine`: the serving system without HTTP, speculative options included.

    from specserve.launch import Engine

    with Engine(speculative_algorithm="NGRAM") as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        print(out["text"], out["meta_info"].get("spec_accept_length"))

Keyword arguments are `ServerArgs` fields (every `--flag` with underscores, the speculative ones
included), plus `speculative_config`: a vLLM-style dict (or its JSON) mapped onto the
speculative options.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specserve.launch.server_args import server_args_class, speculation
from specserve.runtime.engine import Engine as _Engine


class Engine(_Engine):
    def __init__(self, **kwargs: Any) -> None:
        cls = server_args_class()
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"Engine() got unknown argument(s) {unknown}")
        if kwargs.get("dp_size", 1) != 1:
            raise ValueError("dp_size > 1 serves replicas behind sglang-router: "
                             "python -m launch_server --dp-size N")
        args = cls(**kwargs).resolve()
        super().__init__(args, speculation(args))
