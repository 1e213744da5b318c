"""`ServerArgs`: the server's options (specserve/runtime/server_args.py) plus every option of every
registered speculative algorithm, and the command line over them.

The speculative fields come from each algorithm's options dataclass
(specserve/speculative/options.py), so a new algorithm's flags, `Engine(**kwargs)` keywords and
`/server_info` keys appear without touching this file. The class is built from the registry when
first asked for (`server_args_class()`; the module attribute `ServerArgs` is that class), and
rebuilt if an algorithm registers later (a plugin). argparse lives here only: flags, defaults,
choices and help come from the fields' metadata; the speculative options are grouped per algorithm
in `--help` (a group per set of algorithms that take an option, so an algorithm's own flags sit
together). `speculation(args)` is what the runtime's processes get of the speculative options. The
launcher's own options (`--dp-size`, `--threads-per-replica`) are declared here too: the runtime's
processes never see them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import specserve.speculative  # noqa: F401 - importing the package registers the algorithms
from specserve.runtime.server_args import BaseServerArgs
from specserve.speculative.options import (
    PREFIX,
    ResolveContext,
    SpecConfig,
    all_options,
    apply_speculative_config,
    resolve_spec_options,
    server_arg_fields,
)
from specserve.speculative.plugin import Speculation
from specserve.speculative.registry import ALGORITHMS

_KINDS = {"int": int, "int | None": int, "float": float, "float | None": float}


def _spec_field(help_text: str) -> Any:
    return field(default=None, metadata={"help": help_text, "choices": None,
                                         "group": "speculative"})


def _dp_field(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text, "choices": None,
                                            "group": "data parallelism"})


@dataclass(frozen=True)
class _DataParallel:
    """The launcher's data-parallel options (specserve/launch/data_parallel.py)."""

    dp_size: int = _dp_field(
        1, "engine replicas behind sglang-router (pip install sglang-router): each replica is "
        "a server of its own (scheduler, model runner, KV cache, prefix cache) on a loopback "
        "port, the router listens on --host/--port and sends a request to the replica whose "
        "prefix cache holds its prompt (cache_aware); a replica that dies is restarted. 1: one "
        "server, no router (docs/scaling.md)")
    threads_per_replica: int | None = _dp_field(
        None, "with --dp-size > 1: torch threads of each replica's model runner (default: the "
        "cores divided by --dp-size, at least 1)")

    def _resolve_data_parallel(self) -> dict:
        if self.dp_size < 1:
            raise ValueError("--dp-size must be positive")
        if self.dp_size == 1:
            if self.threads_per_replica is not None:
                raise ValueError("--threads-per-replica needs --dp-size > 1 (one server takes "
                                 "--num-threads)")
            return {}
        if self.num_threads is not None:
            raise ValueError("--num-threads is one server's; with --dp-size use "
                             "--threads-per-replica")
        if self.nnodes > 1 or self.dist_init_addr:
            raise ValueError("--dp-size replicas run on this host, each its own tensor-parallel "
                             "group on a loopback port: --nnodes and --dist-init-addr are for "
                             "one server (several hosts: docs/scaling.md)")
        if self.threads_per_replica is None:
            return {"threads_per_replica": max(1, (os.cpu_count() or 1) // self.dp_size)}
        if self.threads_per_replica < 1:
            raise ValueError("--threads-per-replica must be positive")
        return {}


class _Speculative:
    """The speculative half of `ServerArgs` (a mixin of methods; the fields are made from the
    registry by `server_args_class`)."""

    def spec_config(self) -> SpecConfig | None:
        """The speculative configuration (None without speculation); call on resolved args."""
        return SpecConfig.from_server_args(self)

    def resolve(self):
        """A copy with "auto"/None values made concrete and every value checked: the
        algorithm's options (`Drafter.resolve_options`), then the server's."""
        args = dataclasses.replace(self, **self._resolve_data_parallel())
        if self.speculative_config is not None:
            args = args._apply_speculative_config()
        if args.speculative_algorithm is not None:
            args = dataclasses.replace(args, **args._resolve_speculative())
        return BaseServerArgs.resolve(args)

    def _apply_speculative_config(self):
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name.startswith(PREFIX) and f.name != "speculative_config"
                 and getattr(self, f.name) != f.default}
        over = apply_speculative_config(given, self.speculative_config)
        unknown = [k for k in over if not hasattr(self, k)]
        assert not unknown, f"speculative_config mapped onto unknown fields {unknown}"
        return dataclasses.replace(self, speculative_config=None, **over)

    def _resolve_speculative(self) -> dict:
        """The algorithm's options with its "auto" values filled (specserve/speculative/options.py:
        `resolve_spec_options`)."""
        from specserve.runtime.model_runner.model_runner import resolve_device

        # (a class built before a plugin registered lacks its fields: they hold defaults)
        given = {n: getattr(self, PREFIX + n) for n in all_options() if hasattr(self, PREFIX + n)}
        ctx = ResolveContext(self.engine(), resolve_device(self.device).type,
                             self.model_path in ("default", None))
        cfg = resolve_spec_options(self.speculative_algorithm, given, ctx)
        return {"speculative_algorithm": cfg.algorithm,
                **{PREFIX + n: v for n, v in cfg.as_dict().items()
                   if n != "algorithm" and hasattr(self, PREFIX + n)}}


_built: tuple[tuple, type] | None = None


def server_args_class() -> type:
    """`BaseServerArgs` plus one field per speculative option of the registered algorithms."""
    global _built
    key = tuple(ALGORITHMS)
    if _built is None or _built[0] != key:
        own = [
            ("speculative_algorithm", str | None, _spec_field(
                "speculative decoding algorithm (none when unset); each algorithm's own options "
                "are listed in its group below")),
            ("speculative_config", str | None, _spec_field(
                "vLLM-style speculative config as JSON, e.g. '{\"method\": \"draft_model\", "
                "\"model\": PATH, \"num_speculative_tokens\": 3}' or '{\"method\": \"ngram\", "
                "\"prompt_lookup_max\": 4}'; mapped onto the --speculative-* options")),
        ]
        cls = dataclasses.make_dataclass(
            "ServerArgs", own + server_arg_fields(),
            bases=(_Speculative, _DataParallel, BaseServerArgs), frozen=True, namespace={
                "__module__": __name__,
                "__doc__": "Server options + the launcher's + every speculative algorithm's "
                           "options."})
        _built = (key, cls)
    return _built[1]


def speculation(args) -> Speculation | None:
    """What the runtime's processes get of resolved `ServerArgs`' speculative options. Without
    an algorithm, a server with a grammar backend drafts the tokens constrained requests'
    grammars force (JUMP_FORWARD, with the stored verify-cost table: no start-up timing)
    unless --disable-grammar-jump-forward."""
    cfg = args.spec_config()
    if cfg is None and args.grammar_backend != "none" and not args.disable_grammar_jump_forward:
        cfg = SpecConfig("JUMP_FORWARD", 1, verify_cost="table")
    return None if cfg is None else Speculation(cfg)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launch_server",
        description="specserve: an LLM server with lossless speculative decoding",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(server_args_class()):
        meta = f.metadata
        group = meta.get("group", "server")
        if group not in groups:
            title = {"server": "server", "speculative": "speculative decoding"}.get(group, group)
            groups[group] = parser.add_argument_group(title)
        flag_name = "--" + f.name.replace("_", "-")
        help_text = meta["help"]
        if f.name == "speculative_algorithm":
            help_text += f"; one of {', '.join(sorted(ALGORITHMS))}"
        if str(f.type) in ("bool", "bool | None") or f.type is bool:
            if f.default is True:  # on by default: --x / --no-x
                groups[group].add_argument(flag_name, action=argparse.BooleanOptionalAction,
                                           default=True, help=help_text)
            else:
                groups[group].add_argument(flag_name, action="store_true", help=help_text)
            continue
        kind = _KINDS.get(str(f.type), str)
        groups[group].add_argument(flag_name, type=kind, default=f.default, help=help_text,
                                   choices=meta.get("choices") if kind is str else None)
    return parser


def to_argv(args) -> list[str]:
    """The flags that `parse_args` reads back as `args` (those away from their defaults)."""
    argv = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def parse_args(argv: list[str] | None = None):
    ns = build_parser().parse_args(argv)
    return server_args_class()(**vars(ns))


def __getattr__(name: str):
    if name == "ServerArgs":
        return server_args_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
