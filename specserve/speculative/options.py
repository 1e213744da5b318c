"""Speculative options: declared once, in the algorithm's own module, as dataclass fields.

An algorithm's options are a frozen dataclass whose fields are made with `option(default,
help)`. The field name is the option's name everywhere: `ServerArgs.speculative_<name>`, the
flag `--speculative-<name-with-dashes>`, `Engine(speculative_<name>=...)`, the key of
`SpecConfig`, of `bench_speculative --configs ALGO:<name>=...` and of `/server_info`. Options
several algorithms share are declared once in a common base class here (`SpecOptions` for
every algorithm, `DraftTreeOptions` for drafters that grow trees from a model's distribution)
and inherited; the same field object then serves them all.

`server_arg_fields()` turns every registered algorithm's options into `ServerArgs` fields
(specserve/runtime/server_args.py); `SpecConfig` is the resolved view the model runner hands a
drafter. A vLLM-style `speculative_config` dict (`{"method": "ngram", "num_speculative_tokens": 3}`,
`{"model": path, ...}`) maps onto the same options (`apply_speculative_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from specserve.speculative.registry import ALGORITHMS

PREFIX = "speculative_"
SHARED_GROUP = "speculative decoding (every algorithm)"


def option(default: Any, help: str, *, choices: tuple | None = None,
           vllm: str | None = None) -> Any:
    """A dataclass field declaring one option: its default, its `--help` text, optionally the
    values it accepts and the vLLM `speculative_config` key that maps onto it."""
    return field(default=default, metadata={"help": help, "choices": choices, "vllm": vllm})


@dataclass(frozen=True)
class SpecOptions:
    """Options every algorithm takes."""

    num_draft_tokens: int | None = option(
        None, "draft tree nodes per request per step, root included (unset: the algorithm's "
        "default for the engine, logged at start-up; model drafters: see "
        "--speculative-num-steps)")
    accept_threshold_single: float = option(
        1.0, "LOSSY when < 1: also accept a draft token whose target probability is at least "
        "this (unseeded sampling only: seeded requests are always verified exactly, their "
        "output equals plain decoding's)")
    accept_threshold_acc: float = option(
        1.0, "LOSSY when < 1: divide the acceptance test's ratio by this (unseeded sampling "
        "only)")
    disable_adaptive: bool = option(
        False, "always draft the full budget, even when drafts keep failing")
    verify_cost: str = option(
        "measure", "the verify-cost curve T(n)/T(1) the speculation controller starts from "
        "(it then learns the curve from the server's own steps): measure (on this machine at "
        "start-up, a few seconds of verify forwards), table (the engine's stored one), or a "
        "JSON file of a curve measured once (as /server_info's verify_cost shows it)")
    tree_ops: str = option(
        "auto", "how a step's trees are verified, same results either way: walk each tree in "
        "Python, or one batched tensor op from the kernel registry (torch reference, Triton); "
        "auto: the registry's best op on CUDA, the walk on the CPU",
        choices=("auto", "walk", "torch", "triton"))


@dataclass(frozen=True)
class DraftTreeOptions(SpecOptions):
    """Options of drafters that grow trees from a model's distribution (a draft head, a draft
    model, the target's own early layers)."""

    draft_model_path: str | None = option(
        None, "EAGLE/EAGLE3: the draft head's checkpoint; STANDALONE: the draft model (HF "
        "directory or .gguf, as llama.cpp's -md; it must share the target's tokenizer); "
        "EARLY_EXIT: an exit adapter (optional); MEDUSA: Medusa heads; MLP_SPECULATOR: an "
        "MLPSpeculator (vLLM's / IBM's layout). Unset with the default model: the shipped one "
        "in assets/", vllm="model")
    num_steps: int | None = option(
        None, "draft tree depth S (unset: chosen per algorithm and engine with "
        "--speculative-eagle-topk and --speculative-num-draft-tokens, logged at start-up)")
    eagle_topk: int | None = option(
        None, "children per expanded node and nodes expanded per step (k = 1 drafts a chain and "
        "forces num-draft-tokens = num-steps + 1)")
    eagle_target_only: bool = option(
        False, "sampling: draft top-k trees and verify with the draft probabilities ignored "
        "(SGLang's target-only) instead of drafting from q and verifying with q")
    draft_matmul_dtype: str = option(
        "auto", "on the CPU, the draft's own torch matmuls (an EAGLE head, a draft model's "
        "reduced LM head, an exit adapter) in float32, bfloat16, or q8_0 / q4_0 blocks on the "
        "CPU engine's kernels (auto: q8_0 where the CPU extension is built, else bfloat16 where "
        "the CPU has bf16 dot-product instructions). Drafts only: the target verifies every "
        "token, so output is unchanged",
        choices=("auto", "float32", "bfloat16", "q8_0", "q4_0"))


class ResolveContext(NamedTuple):
    """What resolving 'auto' option values may depend on."""

    engine: str  # "cpu" (the C++ engine) or "torch"
    device: str  # "cpu" or "cuda"
    default_model: bool  # the target is the embedded default model


def check_tree_shape(steps: int | None, topk: int | None, n: int | None,
                     auto: tuple[int, int, int]) -> tuple[int, int, int]:
    """(num_steps, topk, num_draft_tokens) of a model drafter's tree: unset values from `auto`;
    top-k 1 is a chain, so num_draft_tokens = num_steps + 1; the tree must hold n nodes."""
    given = (steps, topk, n)
    steps, topk, n = (a if g is None else g for g, a in zip(given, auto))
    if steps < 1 or topk < 1:
        raise ValueError(f"{flag('num_steps')} and {flag('eagle_topk')} must be >= 1")
    if topk == 1:
        n = steps + 1
    most = 1 + topk + (steps - 1) * topk * topk  # root + every candidate the tree can hold
    if n > most:
        raise ValueError(f"{flag('num_draft_tokens')} {n} exceeds the {most} nodes a tree of "
                         f"{steps} steps and top-k {topk} can hold")
    return steps, topk, n


def flag(name: str) -> str:
    return "--" + (PREFIX + name).replace("_", "-")


def option_fields(options_cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(options_cls)}


def all_options() -> dict[str, tuple[dataclasses.Field, list[str]]]:
    """Every option of every registered algorithm: name -> (field, algorithms taking it), in
    declaration order (shared options first). An option name declared by two different fields
    is an error: options are declared once."""
    out: dict[str, tuple[dataclasses.Field, list[str]]] = {
        f.name: (f, []) for f in dataclasses.fields(SpecOptions)}
    for algo, cls in ALGORITHMS.items():
        for f in dataclasses.fields(cls.options):
            have = out.get(f.name)
            if have is None:
                out[f.name] = (f, [algo])
                continue
            assert have[0] is f, (
                f"option {f.name!r} of {algo} is declared again instead of inherited from the "
                "class that declares it")
            have[1].append(algo)
    return out


def group_of(algos: list[str]) -> str:
    everyone = set(ALGORITHMS)
    return SHARED_GROUP if set(algos) >= everyone else ", ".join(algos)


def server_arg_fields() -> list[tuple[str, str, dataclasses.Field]]:
    """(ServerArgs field name, type, field) for every option, with `help`, `choices` and the
    argparse `group` in the metadata."""
    out = []
    for name, (f, algos) in all_options().items():
        meta = {**f.metadata, "group": group_of(algos), "algorithms": tuple(algos)}
        out.append((PREFIX + name, f.type, field(default=f.default, metadata=meta)))
    return out


class SpecConfig:
    """The speculative configuration a drafter and the worker read: the algorithm, and every
    option by name (defaults for those not given). Immutable.

        SpecConfig("NGRAM", 8, ngram_capacity=1000).ngram_capacity  # -> 1000
    """

    __slots__ = ("algorithm", "_values")

    def __init__(self, algorithm: str, num_draft_tokens: int | None = None, **options: Any):
        known = all_options()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown speculative option(s) {unknown}")
        values = {name: f.default for name, (f, _) in known.items()}
        values.update(options, num_draft_tokens=num_draft_tokens)
        object.__setattr__(self, "algorithm", algorithm)
        object.__setattr__(self, "_values", values)

    @classmethod
    def from_server_args(cls, args: Any) -> SpecConfig | None:
        """The speculative part of resolved `ServerArgs` (None without speculation)."""
        if getattr(args, "speculative_algorithm", None) is None:
            return None
        values = {f.name[len(PREFIX):]: getattr(args, f.name) for f in dataclasses.fields(args)
                  if "algorithms" in f.metadata}
        return cls(args.speculative_algorithm, **values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("SpecConfig is immutable")

    def options(self, options_cls: type) -> Any:
        """These values as an algorithm's options dataclass."""
        return options_cls(**{n: self._values[n] for n in option_fields(options_cls)})

    def as_dict(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, **self._values}

    def __reduce__(self):
        # a spawned process gets it pickled at its start, rebuilt through the constructor
        # against that process's registry: only the values set away from their defaults travel
        # (an algorithm registered here after start-up, a test's, is unknown there)
        known = all_options()
        given = {n: v for n, v in self._values.items()
                 if n == "num_draft_tokens" or v != known[n][0].default}
        return _spec_config, (self.algorithm, given)

    def __repr__(self) -> str:
        return f"SpecConfig({self.algorithm!r}, {self._values})"


def resolve_spec_options(algorithm: str, given: dict[str, Any], ctx: ResolveContext
                         ) -> SpecConfig:
    """The resolved configuration of `algorithm` from option values by name (unset ones take
    their defaults, "auto" ones the algorithm's `resolve_options`); an option of another
    algorithm set away from its default is an error."""
    from specserve.speculative.registry import check_algorithm

    algo = check_algorithm(algorithm)
    cls = ALGORITHMS[algo]
    mine = option_fields(cls.options)
    for name, (f, algos) in all_options().items():
        if name not in mine and name in given and given[name] != f.default:
            raise ValueError(f"{flag(name)} applies to --speculative-algorithm "
                             f"{' / '.join(algos)}, not {algo}")
    opts = cls.options(**{n: given.get(n, f.default) for n, f in mine.items()})
    opts = cls.resolve_options(opts, ctx)
    check_verify_cost(opts.verify_cost)
    return SpecConfig(algo, **{n: getattr(opts, n) for n in mine})


def check_verify_cost(value: str) -> None:
    """--speculative-verify-cost: measure, table, or a readable curve file."""
    if value in ("measure", "table"):
        return
    from specserve.runtime.verify_cost import load_verify_cost

    try:
        load_verify_cost(value)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
        raise ValueError(f"{flag('verify_cost')} must be measure, table or a JSON file of a "
                         f"curve ({{\"rows\": [1, ...], \"ratios\": [1.0, ...]}}): {value!r}: "
                         f"{exc}") from exc


def _spec_config(algorithm: str, values: dict[str, Any]) -> SpecConfig:
    return SpecConfig(algorithm, **values)


class SpecConfigError(ValueError):
    """A bad `speculative_config` / `--speculative-config`."""


def apply_speculative_config(given: dict[str, Any], config: dict[str, Any] | str
                             ) -> dict[str, Any]:
    """Map a vLLM-style `speculative_config` onto ServerArgs overrides.

    `given` holds the explicitly set `speculative_*` ServerArgs values; a key of `config` that
    names an option set differently there is a conflict. Keys: `method` (vLLM's method names or
    ours: ngram, eagle, eagle3, draft_model, early_exit, ...; without it, `model` means a draft
    model), `num_speculative_tokens` k (a chain of k drafts, as vLLM's: the algorithm maps it,
    `Drafter.chain_options`), every option's vLLM key (`model`, `prompt_lookup_max`, ...) and
    every option by our name (with or without the `speculative_` prefix)."""
    import json

    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise SpecConfigError(f"--speculative-config is not valid JSON: {exc.msg}") from None
    if not isinstance(config, dict):
        raise SpecConfigError("speculative_config must be a JSON object / dict")
    registry = ALGORITHMS
    known = all_options()
    rest = dict(config)
    method = rest.pop("method", None)
    if method is None:
        if "model" not in rest:
            raise SpecConfigError("speculative_config needs 'method' (e.g. 'ngram', 'eagle3', "
                                  "'draft_model') or a draft 'model'")
        method = "draft_model"
    by_method = {m.lower(): name for name, cls in registry.items()
                 for m in (name, *cls.vllm_methods)}
    algo = by_method.get(str(method).lower())
    if algo is None:
        raise SpecConfigError(f"speculative_config method {method!r} is not one of "
                              f"{sorted(by_method)}")
    out: dict[str, Any] = {"speculative_algorithm": algo}
    k = rest.pop("num_speculative_tokens", None)
    if k is not None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise SpecConfigError("num_speculative_tokens must be a positive integer")
        out.update({PREFIX + n: v for n, v in registry[algo].chain_options(k).items()})
    by_vllm = {f.metadata["vllm"]: n for n, (f, _) in known.items() if f.metadata.get("vllm")}
    for key, value in rest.items():
        name = by_vllm.get(key) or key.removeprefix(PREFIX)
        if name not in known or name == "algorithm":
            raise SpecConfigError(
                f"speculative_config key {key!r} is not one we map; accepted: method, "
                f"num_speculative_tokens, {', '.join(sorted(by_vllm))}, or an option name "
                f"({', '.join(sorted(known))})")
        out[PREFIX + name] = value
    for key, value in out.items():
        if key in given and given[key] != value:
            raise SpecConfigError(f"speculative_config sets {key} = {value!r} but it is also "
                                  f"given as {given[key]!r}")
    return out
