"""`BaseServerArgs`: the server's own options, one dataclass.

Each field is declared here with its `--help` text. The launcher's `ServerArgs`
(specserve/launch/server_args.py) adds every option of every registered speculative algorithm; the
runtime's processes read only the fields below. "auto" values are resolved in `resolve()`,
which returns a new object and never mutates the original.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from specserve.kernels.cpu import ACTIVATION_DIGITS, DEFAULT_ACTIVATION_DIGITS
from specserve.runtime.constrained import GRAMMAR_BACKENDS
from specserve.runtime.proc_utils import free_port
from specserve.runtime.tool_calls import TOOL_CALL_PARSERS


def _arg(default: Any, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "group": "server"})


@dataclass(frozen=True)
class BaseServerArgs:
    """The server's own options; `ServerArgs` adds the speculative ones."""

    model_path: str = _arg("default", "HF model directory (Llama/Mistral/Qwen2/Qwen3), a .gguf "
                           "file, or 'default' (the embedded SmolLM2-135M-Instruct)")
    host: str = _arg("127.0.0.1", "address to bind; 127.0.0.1 keeps the server local")
    port: int = _arg(30000, "HTTP port")
    api_key: str | None = _arg(None, "require 'Authorization: Bearer <key>' on every endpoint "
                               "but /health")
    dtype: str = _arg("auto", "torch engine weights/KV dtype: auto (fp32 on CPU, bf16 on CUDA), "
                      "float32, bfloat16, float16 (the CPU engine keeps its weights packed and "
                      "computes in float32)", ("auto", "float32", "bfloat16", "float16"))
    weight_format: str = _arg(
        "auto", "auto: on the CPU, the C++ engine (specserve/kernels/cpu) with the checkpoint's "
        "own format "
        "(a GGUF's Q4_1/Q8_0 blocks, an HF checkpoint's float dtype), batch-invariant so "
        "speculative output equals plain output bit for bit; elsewhere the torch engine. torch: "
        "the torch reference engine. f32|bf16|f16|q8_0|q4_0|q4_1: the CPU engine with every "
        "linear converted to that format (q* formats quantize: lossy)")
    activation_digits: int = _arg(
        DEFAULT_ACTIVATION_DIGITS, "CPU engine, block formats: int8 digits per activation (3: "
        "~22 bits, logits within ~1e-4 of float32; 2: ~15 bits; 1: int8 activations like "
        "llama.cpp, fastest verify, least accurate)", ACTIVATION_DIGITS)
    kv_cache_dtype: str = _arg(
        "auto", "KV cache dtype. auto: the activations' (float32 on the CPU engine, --dtype on "
        "the torch engine); float16: the CPU engine stores K / V as IEEE half (half the KV "
        "memory and the attention's memory traffic; attention then sees K / V rounded to 11 "
        "bits, the same for every batch, so speculative output still equals plain output)",
        ("auto", "float32", "float16"))
    device: str = _arg("auto", "auto, cpu or cuda", ("auto", "cpu", "cuda"))
    attention_backend: str = _arg("auto", "auto (cpu with the CPU engine; on CUDA flashinfer, "
                                  "then triton, where they import; else torch_native), "
                                  "torch_native, cpu, triton (CUDA, or the CPU under "
                                  "TRITON_INTERPRET=1) or flashinfer (CUDA); triton and "
                                  "flashinfer are not yet run on a GPU",
                                  ("auto", "torch_native", "cpu", "triton", "flashinfer"))
    max_running_requests: int = _arg(32, "most requests decoding at once")
    max_total_tokens: int | None = _arg(None, "KV cache capacity in tokens (default: sized from "
                                        "context length)")
    context_length: int | None = _arg(None, "longest prompt + output per request (default: the "
                                      "model's)")
    chunked_prefill_size: int | None = _arg(
        None, "most prompt tokens prefilled in one step, decode rows riding along included; "
        "longer prompts are split. A step's prefill stalls every running stream for its "
        "length, so the default is 256 on the CPU (~0.3 s of prompt at ~1.15 ms a token; 512 "
        "doubled ITL p99 at 8-32 streams for no throughput: docs/benchmarks.md) and 512 on CUDA")
    schedule_policy: str = _arg("fcfs", "fcfs (arrival order) or lpm (longest cached prefix "
                                "first)", ("fcfs", "lpm"))
    enable_priority_scheduling: bool = _arg(
        False, "order the queue by each request's `priority` (then arrival; a request without "
        "one comes last), and let a waiting "
        "request take the seat and KV of running requests less urgent than it by more than "
        "--priority-scheduling-preemption-threshold (they go back to the queue and resume "
        "from the prefix cache; outputs unchanged). Off: `priority` is ignored (SGLang's "
        "options and semantics)")
    schedule_low_priority_values_first: bool = _arg(
        False, "with --enable-priority-scheduling: a lower `priority` value is more urgent "
        "(default: a higher value is, as in SGLang)")
    priority_scheduling_preemption_threshold: int = _arg(
        10, "with --enable-priority-scheduling: a waiting request preempts a running one only "
        "when it is more urgent by more than this many priority levels (SGLang's default)")
    abort_on_priority_when_disabled: bool = _arg(
        False, "without --enable-priority-scheduling, refuse (HTTP 400) a request that sets a "
        "`priority` instead of ignoring it (SGLang's option)")
    disable_radix_cache: bool = _arg(False, "do not reuse KV of shared prompt prefixes")
    shared_prefill_min_tokens: int = _arg(
        32, "a waiting request sharing at least this many uncached prompt tokens with a prompt "
        "being prefilled waits until that prompt is cached, then prefills only the rest "
        "(SGLang's in-batch prefix caching and its threshold: the samples of one prompt, a "
        "burst behind one system prompt); 0 prefills them side by side")
    enable_metrics: bool = _arg(False, "serve Prometheus metrics at /metrics")
    disable_playground: bool = _arg(False, "do not serve the chat playground page at / "
                                    "(docs/playground.md)")
    log_level: str = _arg("info", "debug, info, warning or error",
                          ("debug", "info", "warning", "error"))
    chat_template: str | None = _arg(None, "a Jinja chat template file, an inline template, "
                                     "or a known name (chatml, gemma) overriding the model's; "
                                     "a model without one serves no chat requests otherwise")
    max_request_bytes: int = _arg(4 * 1024 * 1024, "largest accepted HTTP request body (413 "
                                  "above)")
    max_queued_requests: int | None = _arg(
        None, "most requests waiting for a running slot (beyond --max-running-requests); a "
        "request, or a batch, that would queue more is refused at once with HTTP 503 \"The "
        "request queue is full.\" (SGLang's option). Under --enable-priority-scheduling the "
        "scheduler applies it per sequence, and a request more urgent than the least urgent "
        "queued one takes its place (that one ends as an abort, SGLang's rule). Default: no "
        "limit")
    max_sequences_per_request: int = _arg(
        1024, "most sequences (prompts x n) one HTTP request may ask for (400 above): one "
        "request's batch queues ahead of every request that comes after it")
    served_model_name: str | None = _arg(None, "model name reported by /v1/models (default: "
                                         "the model dir name)")
    incremental_streaming_output: bool = _arg(
        False, "streamed /generate chunks carry only what is new since the previous chunk "
        "(text, output_ids, output_token_logprobs, output_top_logprobs; SGLang's option) "
        "instead of everything so far")
    grammar_backend: str = _arg(
        "xgrammar", "grammar backend of constrained decoding (response_format json_schema / "
        "json_object, json_schema / regex / ebnf / structural_tag sampling parameters, forced "
        "tool calls): xgrammar precomputes masks when it compiles (~2 s for a schema with "
        "long string maxLength), llguidance computes them as it goes (a new grammar starts at "
        "once); none refuses such requests with HTTP 400", GRAMMAR_BACKENDS)
    grammar_compile_timeout: float = _arg(
        10.0, "seconds a grammar may take to compile (in a thread of the HTTP process; the "
        "request is a 400 beyond it, and so is the same grammar again)")
    disable_grammar_jump_forward: bool = _arg(
        False, "without a speculative algorithm, constrained requests decode one token per step "
        "instead of drafting the tokens their grammar forces and verifying them in one forward "
        "(JUMP_FORWARD; every speculative algorithm drafts them too)")
    constrained_json_disable_any_whitespace: bool = _arg(
        False, "JSON Schema outputs without free whitespace: compact JSON ({\"a\": 1, \"b\": "
        "2}) instead of any whitespace between tokens (SGLang's option)")
    tool_call_parser: str = _arg(
        "auto", "how tool calls look in the model's output, for `tools` on /v1/chat/completions: "
        "smollm2 (<tool_call>[{\"name\": ..., \"arguments\": ...}]</tool_call>), hermes "
        "(<tool_call>{...}</tool_call> per call, Qwen2.5 / Hermes); auto: hermes when the chat "
        "template renders `tools` itself, else smollm2 with its tool prompt "
        "(docs/structured_output.md)", TOOL_CALL_PARSERS)
    num_threads: int | None = _arg(None, "torch threads in the model-runner process (default: "
                                   "all cores)")
    tp_size: int = _arg(
        1, "tensor parallelism: split the model over this many processes (ranks): attention "
        "by KV heads, the MLP by columns, the vocabulary by rows (docs/scaling.md); each rank "
        "has --num-threads threads (default: the cores over the ranks on this node), or one "
        "GPU on CUDA")
    nnodes: int = _arg(1, "hosts the --tp-size ranks span (each runs this command with its "
                       "--node-rank; ranks are split evenly)")
    node_rank: int = _arg(0, "this host's index among --nnodes; 0 serves HTTP, the others "
                          "only run their ranks")
    dist_init_addr: str | None = _arg(
        None, "host:port where the tensor-parallel ranks meet (node 0 listens there); needed "
        "with --nnodes > 1, else a free loopback port")
    tp_comm: str = _arg(
        "auto", "how tensor-parallel ranks exchange partial sums: shm (a shared-memory segment, "
        "ranks on one host), gloo (torch.distributed over TCP, also across hosts); auto: shm "
        "with --nnodes 1, else gloo", ("auto", "shm", "gloo"))
    heap_trim_interval: float = _arg(
        30.0, "seconds between the model runner's returns of freed heap memory to the OS "
        "(glibc malloc_trim), which it also does once whenever it goes idle. The buffers a "
        "step frees otherwise stay resident (~0.5 GB at 64 streams) after the load is gone; "
        "0 turns it off")
    def resolve(self):
        """Return a copy with "auto"/None values made concrete and every value checked."""
        from specserve.runtime.model_loader.default_model import resolve_model_path
        from specserve.runtime.model_runner.model_runner import WEIGHT_FORMATS

        for f in dataclasses.fields(BaseServerArgs):
            allowed = f.metadata.get("choices")
            if f.name == "weight_format":
                allowed = WEIGHT_FORMATS
            if allowed and getattr(self, f.name) not in allowed:
                raise ValueError(f"--{f.name.replace('_', '-')} must be one of {allowed}")
        for name in ("max_running_requests", "chunked_prefill_size", "max_request_bytes",
                     "max_sequences_per_request"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        for name in ("max_queued_requests", "shared_prefill_min_tokens",
                     "priority_scheduling_preemption_threshold"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if not self.grammar_compile_timeout > 0:
            raise ValueError("--grammar-compile-timeout must be > 0")
        if not self.heap_trim_interval >= 0:
            raise ValueError("--heap-trim-interval must be >= 0 (0 turns it off)")
        if self.tp_size < 1 or self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size ({self.tp_size}) must be a positive multiple of "
                             f"--nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}")
        init_addr = self.dist_init_addr
        if self.nnodes > 1 and not init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        if init_addr and (":" not in init_addr or not init_addr.rsplit(":", 1)[1].isdigit()):
            raise ValueError(f"--dist-init-addr must be HOST:PORT, got {init_addr!r}")
        if self.tp_size > 1 and not init_addr:
            init_addr = f"127.0.0.1:{free_port()}"
        if self.tp_comm == "shm" and self.nnodes > 1:
            raise ValueError("--tp-comm shm needs every rank on one host (--nnodes 1)")
        comm = self.tp_comm if self.tp_comm != "auto" else (
            "shm" if self.nnodes == 1 else "gloo")
        model_dir = str(resolve_model_path(self.model_path))
        name = self.served_model_name or (
            "SmolLM2-135M-Instruct" if self.model_path in ("default", None)
            else os.path.basename(os.path.normpath(self.model_path))
        )
        threads = self.num_threads or max(1, (os.cpu_count() or 1) // self.local_ranks)
        chunk = self.chunked_prefill_size or (512 if self._on_cuda() else 256)
        return dataclasses.replace(
            self, model_path=model_dir, served_model_name=name, num_threads=threads,
            chunked_prefill_size=chunk, dist_init_addr=init_addr, tp_comm=comm,
        )

    @property
    def local_ranks(self) -> int:
        """Tensor-parallel ranks on this host."""
        return self.tp_size // self.nnodes

    def node_tp_ranks(self) -> range:
        """This host's tensor-parallel ranks."""
        return range(self.node_rank * self.local_ranks, (self.node_rank + 1) * self.local_ranks)

    def server_part(self) -> BaseServerArgs:
        """These options without the launcher's additions (what the runtime's processes get)."""
        return BaseServerArgs(**{f.name: getattr(self, f.name)
                                 for f in dataclasses.fields(BaseServerArgs)})

    def _on_cuda(self) -> bool:
        if self.device != "auto":
            return self.device == "cuda"
        import torch

        return torch.cuda.is_available()

    def engine(self) -> str:
        """The engine these options run: "cpu" (the C++ engine) or "torch"."""
        from specserve.runtime.model_runner.model_runner import resolve_device, resolve_engine

        return resolve_engine(self.weight_format, resolve_device(self.device), self.dtype)
