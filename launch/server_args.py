"""The command line: argparse over `ServerArgs`' fields (runtime/server_args.py), the only
argparse of the server. Flags, defaults, choices and help come from the fields' metadata; the
speculative options are grouped per algorithm in `--help` (a group per set of algorithms that
take an option, so an algorithm's own flags sit together)."""

from __future__ import annotations

import argparse
import dataclasses

from runtime.server_args import server_args_class

_KINDS = {"int": int, "int | None": int, "float": float, "float | None": float}


def build_parser() -> argparse.ArgumentParser:
    from speculative.base import ALGORITHMS

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
        flag = "--" + f.name.replace("_", "-")
        help_text = meta["help"]
        if f.name == "speculative_algorithm":
            help_text += f"; one of {', '.join(sorted(ALGORITHMS))}"
        if str(f.type) in ("bool", "bool | None") or f.type is bool:
            if f.default is True:  # on by default: --x / --no-x
                groups[group].add_argument(flag, action=argparse.BooleanOptionalAction,
                                           default=True, help=help_text)
            else:
                groups[group].add_argument(flag, action="store_true", help=help_text)
            continue
        kind = _KINDS.get(str(f.type), str)
        groups[group].add_argument(flag, type=kind, default=f.default, help=help_text,
                                   choices=meta.get("choices") if kind is str else None)
    return parser


def parse_args(argv: list[str] | None = None):
    ns = build_parser().parse_args(argv)
    return server_args_class()(**vars(ns))


def __getattr__(name: str):
    if name == "ServerArgs":
        return server_args_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
