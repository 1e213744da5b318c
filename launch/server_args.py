"""`ServerArgs`: the one configuration dataclass; argparse lives only here.

Defaults are read from the dataclass. "auto" values are resolved in `resolve()`, which returns a
new object and never mutates the original.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path

from kernels.cpu import ACTIVATION_DIGITS, DEFAULT_ACTIVATION_DIGITS

HELP = {
    "model_path": "HF model directory (Llama/Mistral/Qwen2/Qwen3), a .gguf file, or 'default' "
    "(the embedded SmolLM2-135M-Instruct)",
    "host": "address to bind; 127.0.0.1 keeps the server local",
    "port": "HTTP port",
    "api_key": "require 'Authorization: Bearer <key>' on every endpoint but /health",
    "dtype": "torch engine weights/KV dtype: auto (fp32 on CPU, bf16 on CUDA), float32, "
    "bfloat16, float16 (the CPU engine keeps its weights packed and computes in float32)",
    "weight_format": "auto: on the CPU, the C++ engine (kernels/cpu) with the checkpoint's own "
    "format (a GGUF's Q4_1/Q8_0 blocks, an HF checkpoint's float dtype), batch-invariant so "
    "speculative output equals plain output bit for bit; elsewhere the torch engine. torch: "
    "the torch reference engine. f32|bf16|f16|q8_0|q4_0|q4_1: the CPU engine with every "
    "linear converted to that format (q* formats quantize: lossy)",
    "activation_digits": "CPU engine, block formats: int8 digits per activation (3: ~22 bits, "
    "logits within ~1e-4 of float32; 2: ~15 bits; 1: int8 activations like llama.cpp, "
    "fastest verify, least accurate)",
    "device": "auto, cpu or cuda",
    "attention_backend": "auto (cpu with the CPU engine, else torch_native), torch_native or cpu",
    "max_running_requests": "most requests decoding at once",
    "max_total_tokens": "KV cache capacity in tokens (default: sized from context length)",
    "context_length": "longest prompt + output per request (default: the model's)",
    "chunked_prefill_size": "most prompt tokens prefilled in one step; longer prompts are split",
    "schedule_policy": "fcfs (arrival order) or lpm (longest cached prefix first)",
    "disable_radix_cache": "do not reuse KV of shared prompt prefixes",
    "enable_metrics": "serve Prometheus metrics at /metrics",
    "log_level": "debug, info, warning or error",
    "chat_template": "a Jinja chat template file (or inline template) overriding the model's",
    "max_request_bytes": "largest accepted HTTP request body (413 above)",
    "served_model_name": "model name reported by /v1/models (default: the model dir name)",
    "num_threads": "torch threads in the model-runner process (default: all cores)",
    "speculative_algorithm": "speculative decoding algorithm: NGRAM, EAGLE or EAGLE3 (none "
    "when unset)",
    "speculative_num_draft_tokens": "draft tree nodes per request per step, root included "
    "(default for NGRAM: 4 on the CPU engine, 8 on the torch engine; EAGLE: see "
    "--speculative-num-steps)",
    "speculative_draft_model_path": "EAGLE/EAGLE3: the draft head's checkpoint directory",
    "speculative_num_steps": "EAGLE/EAGLE3: draft tree depth S (unset: chosen for the device "
    "with --speculative-eagle-topk and --speculative-num-draft-tokens; cpu 2/2/4, cuda 5/4/8)",
    "speculative_draft_matmul_dtype": "EAGLE/EAGLE3 on the CPU: the draft head's matmuls in "
    "float32, bfloat16, or q8_0 / q4_0 blocks on the CPU engine's kernels (auto: q8_0 where "
    "the CPU extension is built, else bfloat16 where the CPU has bf16 dot-product "
    "instructions). Drafts only: verification is the target's, so output is unchanged",
    "speculative_eagle_topk": "EAGLE/EAGLE3: children per expanded node and nodes expanded per "
    "step (k = 1 drafts a chain and forces num-draft-tokens = num-steps + 1)",
    "speculative_eagle_target_only": "EAGLE/EAGLE3 sampling: draft top-k trees and verify with "
    "the draft probabilities ignored (SGLang's target-only) instead of drafting from q and "
    "verifying with q",
    "speculative_token_map": "EAGLE-1/2: draft only over these target token ids (SGLang's hot "
    "token map: .pt read with weights_only, .safetensors, .json or .npy); lossless, EAGLE-3 "
    "heads carry their own draft vocabulary",
    "speculative_accept_threshold_single": "LOSSY when < 1: also accept a draft token whose "
    "target probability is at least this (unseeded sampling only: seeded requests are always "
    "verified exactly, their output equals plain decoding's)",
    "speculative_accept_threshold_acc": "LOSSY when < 1: divide the acceptance test's ratio by "
    "this (unseeded sampling only)",
    "speculative_disable_adaptive": "always draft the full budget, even when drafts keep failing",
    "speculative_ngram_capacity": "NGRAM: most trie nodes kept (least recently used evicted)",
    "speculative_ngram_max_trie_depth": "NGRAM: longest n-gram stored and suffix matched",
    "speculative_ngram_min_match_window": "NGRAM: shortest context suffix that counts as a match",
    "speculative_ngram_max_bfs_breadth": "NGRAM: tree breadth at depth 1 (BFS)",
    "speculative_ngram_min_bfs_breadth": "NGRAM: tree breadth at the deepest level (BFS)",
    "speculative_ngram_match_type": "NGRAM: BFS (most recent continuations) or PROB (most "
    "frequent)",
    "speculative_ngram_external_corpus_path": "NGRAM: JSONL/text corpus preloaded into the trie",
    "speculative_ngram_disable_match_sizing": "NGRAM: draft the whole budget whenever the "
    "context matches, instead of sizing each tree by the match length (longer match, larger "
    "tree; a backed-off request drafts again on a long match)",
    "speculative_ngram_disable_own_context": "NGRAM: on a 1- or 2-token context match, draft "
    "from the trie alone, instead of from the request's own prompt and output first (the trie "
    "fills what is left)",
    "speculative_ngram_max_draft_tokens": "NGRAM: tree nodes (root included) a request may "
    "draft while the step's total stays within it, i.e. when it decodes alone: on a long "
    "context match with match sizing, else after a step that accepted a whole default-size "
    "draft (default: 2x --speculative-num-draft-tokens; equal to it turns deep drafts off)",
}


# Tree nodes per step (root included) when --speculative-num-draft-tokens is unset, by engine.
# torch engine (fp32, weight-bandwidth-bound): a verify pass of 8 nodes costs ~1.15x a decode
# step. CPU engine: ~5x faster decode, so each node is dearer (T(4)/T(1) ~1.5, T(8)/T(1) ~2.4);
# on train-split rewrite/ShareGPT prompts 4 nodes beat 6, 8 and 12 (docs/benchmarks.md).
DEFAULT_NUM_DRAFT_TOKENS = {"NGRAM": {"cpu": 4, "torch": 8}}
# EAGLE (num_steps, topk, num_draft_tokens) when unset, by device type. CPU: every draft step
# costs a head layer plus an LM-head matmul, and a verify node ~1 ms (~5% of a decode step), so
# a shallow, narrow tree pays off: with the shipped head (acceptance at depth 3 ~0.05), 2 steps
# of top-2 and 4 nodes beat 3 steps of top-4 and 8 nodes (1.29x against 1.14x) on train-split
# ShareGPT prompts (docs/benchmarks.md, "EAGLE-3 tree on the CPU"). CUDA: SGLang's Llama default.
EAGLE_TREE_DEFAULTS = {"cpu": (2, 2, 4), "cuda": (5, 4, 8)}
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3")
# the EAGLE-3 head trained for the default model (speculative/train, model card in its README)
DEFAULT_EAGLE3_HEAD = (Path(__file__).resolve().parents[1] / "assets"
                       / "eagle3-smollm2-135m-instruct")


@dataclass(frozen=True)
class ServerArgs:
    model_path: str = "default"
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    dtype: str = "auto"
    weight_format: str = "auto"
    activation_digits: int = DEFAULT_ACTIVATION_DIGITS
    device: str = "auto"
    attention_backend: str = "auto"
    max_running_requests: int = 32
    max_total_tokens: int | None = None
    context_length: int | None = None
    chunked_prefill_size: int = 512
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    enable_metrics: bool = False
    log_level: str = "info"
    chat_template: str | None = None
    max_request_bytes: int = 4 * 1024 * 1024
    served_model_name: str | None = None
    num_threads: int | None = None
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_eagle_target_only: bool = False
    speculative_draft_matmul_dtype: str = "auto"
    speculative_token_map: str | None = None
    speculative_accept_threshold_single: float = 1.0
    speculative_accept_threshold_acc: float = 1.0
    speculative_disable_adaptive: bool = False
    speculative_ngram_capacity: int = 1_000_000
    speculative_ngram_max_trie_depth: int = 18
    speculative_ngram_min_match_window: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_external_corpus_path: str | None = None
    speculative_ngram_max_draft_tokens: int | None = None
    speculative_ngram_disable_match_sizing: bool = False
    speculative_ngram_disable_own_context: bool = False

    def spec_config(self):
        """The speculative configuration (None without speculation); call on resolved args."""
        if self.speculative_algorithm is None:
            return None
        from speculative.base import SpecConfig

        tree = {k: v for k, v in (("num_steps", self.speculative_num_steps),
                                  ("eagle_topk", self.speculative_eagle_topk)) if v is not None}
        return SpecConfig(
            algorithm=self.speculative_algorithm,
            num_draft_tokens=self.speculative_num_draft_tokens,
            draft_model_path=self.speculative_draft_model_path,
            eagle_target_only=self.speculative_eagle_target_only,
            draft_matmul_dtype=self.speculative_draft_matmul_dtype,
            token_map=self.speculative_token_map,
            **tree,
            ngram_capacity=self.speculative_ngram_capacity,
            ngram_max_trie_depth=self.speculative_ngram_max_trie_depth,
            ngram_min_match_window=self.speculative_ngram_min_match_window,
            ngram_max_bfs_breadth=self.speculative_ngram_max_bfs_breadth,
            ngram_min_bfs_breadth=self.speculative_ngram_min_bfs_breadth,
            ngram_match_type=self.speculative_ngram_match_type,
            ngram_external_corpus_path=self.speculative_ngram_external_corpus_path,
            ngram_match_sizing=not self.speculative_ngram_disable_match_sizing,
            ngram_own_context=not self.speculative_ngram_disable_own_context,
            accept_threshold_single=self.speculative_accept_threshold_single,
            accept_threshold_acc=self.speculative_accept_threshold_acc,
            adaptive=not self.speculative_disable_adaptive,
        )

    def resolve(self) -> ServerArgs:
        """Return a copy with "auto"/None values made concrete and every value checked."""
        from runtime.model_loader.default_model import resolve_model_path
        from runtime.model_runner.model_runner import WEIGHT_FORMATS

        choices = {
            "dtype": ("auto", "float32", "bfloat16", "float16"),
            "device": ("auto", "cpu", "cuda"),
            "attention_backend": ("auto", "torch_native", "cpu"),
            "weight_format": WEIGHT_FORMATS,
            "activation_digits": ACTIVATION_DIGITS,
            "schedule_policy": ("fcfs", "lpm"),
            "log_level": ("debug", "info", "warning", "error"),
            "speculative_draft_matmul_dtype": ("auto", "float32", "bfloat16", "q8_0", "q4_0"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {allowed}")
        for name in ("max_running_requests", "chunked_prefill_size", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        spec = {}
        if self.speculative_algorithm is not None:
            from speculative.base import check_algorithm

            algo = check_algorithm(self.speculative_algorithm)
            if self.speculative_token_map is not None:
                self._check_token_map(algo)
            if algo in EAGLE_ALGORITHMS:
                spec = self._eagle_tree()
                n = spec["speculative_num_draft_tokens"]
            else:
                n = self.speculative_num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS[algo][
                    self._engine()]
            if n < 1:
                raise ValueError("--speculative-num-draft-tokens must be >= 1")
            deep = self.speculative_ngram_max_draft_tokens
            if algo == "NGRAM":
                deep = 2 * n if deep is None else deep
                if deep < n:
                    raise ValueError("--speculative-ngram-max-draft-tokens must be >= "
                                     f"--speculative-num-draft-tokens ({n}), got {deep}")
            elif deep is not None:
                raise ValueError("--speculative-ngram-max-draft-tokens applies to "
                                 f"--speculative-algorithm NGRAM, not {algo}")
            spec["speculative_ngram_max_draft_tokens"] = deep
            if self.speculative_ngram_match_type not in ("BFS", "PROB"):
                raise ValueError("--speculative-ngram-match-type must be BFS or PROB")
            for name in ("single", "acc"):
                v = getattr(self, f"speculative_accept_threshold_{name}")
                if not 0.0 < v <= 1.0:
                    raise ValueError(f"--speculative-accept-threshold-{name} must be in (0, 1]")
            spec = {**spec, "speculative_algorithm": algo, "speculative_num_draft_tokens": n}
        model_dir = str(resolve_model_path(self.model_path))
        name = self.served_model_name or (
            "SmolLM2-135M-Instruct" if self.model_path in ("default", None)
            else os.path.basename(os.path.normpath(self.model_path))
        )
        threads = self.num_threads or os.cpu_count() or 1
        return dataclasses.replace(
            self, model_path=model_dir, served_model_name=name, num_threads=threads, **spec
        )

    def _engine(self) -> str:
        from runtime.model_runner.model_runner import resolve_device, resolve_engine

        return resolve_engine(self.weight_format, resolve_device(self.device), self.dtype)

    def _check_token_map(self, algo: str) -> None:
        """--speculative-token-map: EAGLE-1/2 only, and a readable file of a known format."""
        from speculative.eagle import TOKEN_MAP_EAGLE3_ERROR
        from speculative.token_map import check_token_map_path

        if algo == "EAGLE3":
            raise ValueError(TOKEN_MAP_EAGLE3_ERROR)
        if algo != "EAGLE":
            raise ValueError(f"--speculative-token-map applies to EAGLE-1/2 heads, not to "
                             f"--speculative-algorithm {algo}")
        check_token_map_path(self.speculative_token_map)

    def _eagle_tree(self) -> dict:
        """EAGLE's (num_steps, topk, num_draft_tokens): unset values from the device's default;
        top-k 1 is a chain, so num_draft_tokens = num_steps + 1."""
        from runtime.model_runner.model_runner import resolve_device

        draft = self.speculative_draft_model_path
        if not draft:
            shipped = (DEFAULT_EAGLE3_HEAD / "config.json").exists()
            if self.speculative_algorithm.upper() != "EAGLE3" or \
                    self.model_path not in ("default", None) or not shipped:
                raise ValueError(f"--speculative-algorithm {self.speculative_algorithm} needs "
                                 "--speculative-draft-model-path (an EAGLE head checkpoint); "
                                 "only the default model with EAGLE3 has a shipped head")
            draft = str(DEFAULT_EAGLE3_HEAD)
        device = resolve_device(self.device).type
        auto = EAGLE_TREE_DEFAULTS.get(device, EAGLE_TREE_DEFAULTS["cpu"])
        given = (self.speculative_num_steps, self.speculative_eagle_topk,
                 self.speculative_num_draft_tokens)
        steps, topk, n = (a if g is None else g for g, a in zip(given, auto))
        if steps < 1 or topk < 1:
            raise ValueError("--speculative-num-steps and --speculative-eagle-topk must be >= 1")
        if topk == 1:
            n = steps + 1
        most = 1 + topk + (steps - 1) * topk * topk  # root + every candidate the tree can hold
        if n > most:
            raise ValueError(f"--speculative-num-draft-tokens {n} exceeds the {most} nodes a "
                             f"tree of {steps} steps and top-k {topk} can hold")
        return {"speculative_num_steps": steps, "speculative_eagle_topk": topk,
                "speculative_num_draft_tokens": n, "speculative_draft_model_path": draft}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launch_server",
        description="specserve: an LLM server with lossless speculative decoding",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=HELP[f.name])
            continue
        kind = {"int": int, "int | None": int, "float": float}.get(str(f.type), str)
        parser.add_argument(flag, type=kind, default=f.default, help=HELP[f.name])
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    return ServerArgs(**vars(ns))
