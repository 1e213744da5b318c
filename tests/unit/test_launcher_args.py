from __future__ import annotations

import dataclasses
import os

import pytest

from specserve.kernels import cpu
from specserve.launch.launcher import main
from specserve.launch.server_args import (
    ServerArgs,
    build_parser,
    parse_args,
    server_args_class,
    speculation,
)


@pytest.mark.parametrize("argv,needle", [
    (["--model-path", "/nonexistent/model"], "does not exist"),
    (["--speculative-algorithm", "FOO"], "unknown --speculative-algorithm 'FOO'; available:"),
    (["--schedule-policy", "random"], "--schedule-policy: invalid choice"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be positive"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8",
      "--speculative-ngram-max-draft-tokens", "4"], "must be >= --speculative-num-draft-tokens"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-ngram-max-draft-tokens", "16"],
     "applies to --speculative-algorithm NGRAM"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-matmul-dtype", "float16"],
     "--speculative-draft-matmul-dtype: invalid choice"),
    (["--speculative-config", "{\"method\": \"hydra\"}"], "method 'hydra' is not one of"),
    (["--speculative-config", "{\"method\": \"ngram\", \"prompt_lookup_max\": 5}",
      "--speculative-ngram-max-trie-depth", "7"], "also given as 7"),
    (["--tp-size", "3", "--nnodes", "2"], "must be a positive multiple of --nnodes"),
    (["--tp-size", "2", "--nnodes", "2"], "--nnodes > 1 needs --dist-init-addr"),
    (["--tp-size", "2", "--dist-init-addr", "localhost"], "must be HOST:PORT"),
    (["--tp-size", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"],
     "--node-rank must be in 0..1"),
    (["--dp-size", "2", "--tp-size", "2", "--dist-init-addr", "h:1"],
     "--nnodes and --dist-init-addr are for one server"),
])
def test_bad_flags_exit_2_with_one_clear_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_every_flag_is_documented_and_defaults_come_from_the_dataclass():
    parser = build_parser()
    defaults = vars(parser.parse_args([]))
    # the class of the current registry (a plugin test may have registered an algorithm since
    # this module imported ServerArgs)
    assert defaults == dict(vars(server_args_class()()))
    for action in parser._actions:
        if action.dest != "help":
            assert action.help, f"--{action.dest} has no help text"
    assert ServerArgs().host == "127.0.0.1"


def test_eagle3_on_the_default_model_uses_the_shipped_head(tmp_path):
    import json

    from specserve.speculative.drafters.eagle import DEFAULT_EAGLE3_HEAD

    args = ServerArgs(speculative_algorithm="EAGLE3").resolve()
    assert args.speculative_draft_model_path == str(DEFAULT_EAGLE3_HEAD)
    weights = DEFAULT_EAGLE3_HEAD / "model.safetensors"
    assert weights.stat().st_size <= 25 * 2**20  # the repository budget for the shipped head
    config = json.loads((DEFAULT_EAGLE3_HEAD / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (DEFAULT_EAGLE3_HEAD / "README.md").exists()  # the model card
    # any other target, or EAGLE-1/2, still needs a path
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        ServerArgs(speculative_algorithm="EAGLE").resolve()
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        ServerArgs(model_path=str(DEFAULT_EAGLE3_HEAD), speculative_algorithm="EAGLE3").resolve()


def test_ngram_deep_drafts_default_to_twice_the_tree_size():
    args = ServerArgs(speculative_algorithm="NGRAM", weight_format="torch").resolve()
    assert (args.speculative_num_draft_tokens, args.speculative_ngram_max_draft_tokens) == (8, 16)
    if cpu.available()[0]:  # the CPU engine's verify nodes are dearer: smaller default trees
        args = ServerArgs(speculative_algorithm="NGRAM").resolve()
        assert (args.speculative_num_draft_tokens,
                args.speculative_ngram_max_draft_tokens) == (4, 8)
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6,
                      speculative_ngram_max_draft_tokens=6).resolve()
    assert args.speculative_ngram_max_draft_tokens == 6  # deep drafts off
    assert ServerArgs().resolve().speculative_ngram_max_draft_tokens is None


def controller_of(args):
    """The scheduler's speculation controller for these resolved args (the stored curve)."""
    from specserve.runtime.verify_cost import stored_verify_cost

    return speculation(args).create_controller(stored_verify_cost("cpu"))


def test_ngram_match_sizing_is_on_by_default_and_one_flag_turns_it_off():
    on = ServerArgs(speculative_algorithm="NGRAM").resolve()
    assert not on.spec_config().ngram_disable_match_sizing
    sizes = controller_of(on).sizes
    assert sizes.deep_for_all and sizes.judges_confidence  # a long match is a sure draft
    off = parse_args(["--speculative-algorithm", "NGRAM",
                      "--speculative-ngram-disable-match-sizing"]).resolve()
    assert off.spec_config().ngram_disable_match_sizing
    sizes = controller_of(off).sizes
    assert not sizes.deep_for_all and not sizes.judges_confidence


def test_the_controller_plans_sizes_unless_the_drafter_cuts_its_own_trees_by_cost():
    """SUFFIX cuts each tree by its nodes' probabilities and the verify-cost curve
    (`worth_drafting`): a request the controller lets draft gets its cap; every other
    algorithm gets planned sizes, and --speculative-disable-adaptive turns the plan off for
    all."""
    suffix = controller_of(ServerArgs(speculative_algorithm="SUFFIX").resolve())
    assert suffix.sizes.self_sized and suffix.adaptive
    for algo in ("NGRAM", "LOOKAHEAD"):
        c = controller_of(ServerArgs(speculative_algorithm=algo).resolve())
        assert not c.sizes.self_sized and c.adaptive
    planned = controller_of(parse_args(["--speculative-algorithm", "SUFFIX",
                                        "--speculative-suffix-planned-sizes"]).resolve())
    assert not planned.sizes.self_sized
    off = controller_of(parse_args(["--speculative-algorithm", "NGRAM",
                                    "--speculative-disable-adaptive"]).resolve())
    assert not off.adaptive


def test_ngram_own_context_is_on_by_default_and_one_flag_turns_it_off():
    assert not ServerArgs(speculative_algorithm="NGRAM").resolve().spec_config(
    ).ngram_disable_own_context
    off = parse_args(["--speculative-algorithm", "NGRAM",
                      "--speculative-ngram-disable-own-context"]).resolve()
    assert off.spec_config().ngram_disable_own_context


def test_draft_matmul_dtype_resolves_per_device_and_cpu(monkeypatch):
    import torch

    import specserve.speculative.drafters.eagle as eagle

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert eagle.draft_matmul_dtype("float32", cpu) == torch.float32
    for has_path, want in ((True, torch.bfloat16), (False, torch.float32)):
        # bfloat16 where oneDNN multiplies bf16; an AVX2-only CPU has no such path: float32
        monkeypatch.setattr(eagle, "onednn_bf16_available", lambda has_path=has_path: has_path)
        assert eagle.draft_matmul_dtype("bfloat16", cpu) == want
    monkeypatch.undo()
    assert eagle.draft_matmul_dtype("bfloat16", cuda) == torch.float32  # nothing is prepacked
    assert eagle.draft_matmul_dtype("q4_0", cpu) == "q4_0"
    assert eagle.draft_matmul_dtype("q8_0", cuda) == torch.float32
    from specserve.kernels import cpu as cpu_ext

    if cpu_ext.available()[0]:  # auto: q8_0 blocks on the CPU engine's kernels
        assert eagle.draft_matmul_dtype("auto", cpu) == "q8_0"
    monkeypatch.setenv("SPECSERVE_DISABLE_CPU_EXT", "1")
    cpu_ext._load.cache_clear()
    try:
        for native, want in ((True, torch.bfloat16), (False, torch.float32)):
            monkeypatch.setattr(eagle, "cpu_has_native_bf16", lambda native=native: native)
            assert eagle.draft_matmul_dtype("auto", cpu) == want
    finally:
        monkeypatch.delenv("SPECSERVE_DISABLE_CPU_EXT")
        cpu_ext._load.cache_clear()
    assert ServerArgs().speculative_draft_matmul_dtype == "auto"
    args = parse_args(["--speculative-algorithm", "EAGLE3", "--speculative-draft-matmul-dtype",
                       "float32"]).resolve()
    assert args.spec_config().draft_matmul_dtype == "float32"


def test_an_option_on_by_default_has_a_no_flag_and_other_algorithms_start_untouched():
    from specserve.launch.server_args import parse_args

    # LOOKAHEAD's pool of context n-grams is on by default: --no-... turns it off
    on = parse_args(["--speculative-algorithm", "LOOKAHEAD"]).resolve()
    off = parse_args(["--speculative-algorithm", "LOOKAHEAD",
                      "--no-speculative-lookahead-pool-from-context"]).resolve()
    assert on.speculative_lookahead_pool_from_context is True
    assert off.speculative_lookahead_pool_from_context is False
    # an option defaulting to True must not read as "set" for another algorithm
    assert parse_args(["--speculative-algorithm", "NGRAM"]).resolve().speculative_algorithm == \
        "NGRAM"


def test_chunked_prefill_size_defaults_by_device():
    """Unset, a step's prompt budget is 256 tokens on the CPU (a step's prefill stalls every
    stream: docs/benchmarks.md, "Prefix cache and chunked prefill") and 512 on CUDA; a given
    value stays."""
    assert ServerArgs().resolve().chunked_prefill_size == 256
    assert ServerArgs(device="cuda").resolve().chunked_prefill_size == 512
    assert ServerArgs(chunked_prefill_size=1024).resolve().chunked_prefill_size == 1024


def test_tensor_parallel_ranks_split_the_cores_and_meet_on_loopback():
    args = ServerArgs(tp_size=2).resolve()
    host, port = args.dist_init_addr.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert args.num_threads == max(1, (os.cpu_count() or 1) // 2)
    two = ServerArgs(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000").resolve()
    assert list(two.node_tp_ranks()) == [2, 3] and two.dist_init_addr == "10.0.0.1:5000"


@pytest.mark.parametrize("argv,needle", [
    (["--dp-size", "0"], "--dp-size must be positive"),
    (["--threads-per-replica", "2"], "--threads-per-replica needs --dp-size > 1"),
    (["--dp-size", "2", "--num-threads", "2"], "with --dp-size use --threads-per-replica"),
    (["--dp-size", "2", "--threads-per-replica", "0"], "--threads-per-replica must be positive"),
])
def test_bad_data_parallel_flags_exit_2_with_one_clear_line(argv, needle, capsys, monkeypatch):
    _never_serve(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def _never_serve(monkeypatch):
    """A flag the launcher wrongly accepts must fail the test, not start replicas."""
    import specserve.launch.data_parallel

    def serve(*args):
        raise AssertionError("the launcher accepted the flags and started serving")

    monkeypatch.setattr(specserve.launch.data_parallel, "serve_data_parallel", serve)


def test_dp_size_without_sglang_router_tells_how_to_install_it(monkeypatch, capsys):
    import specserve.launch.router

    _never_serve(monkeypatch)
    monkeypatch.setattr(specserve.launch.router.importlib.util, "find_spec",
                        lambda name: None if name == "sglang_router" else object())
    with pytest.raises(SystemExit) as exc:
        main(["--dp-size", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("pip install sglang-router") and "\n" not in err


def test_replica_threads_default_to_the_cores_shared_out(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert parse_args(["--dp-size", "3"]).resolve().threads_per_replica == 2
    assert parse_args(["--dp-size", "16"]).resolve().threads_per_replica == 1
    assert parse_args(["--dp-size", "2", "--threads-per-replica", "3"]).resolve() \
        .threads_per_replica == 3
    assert parse_args([]).resolve().threads_per_replica is None


@pytest.mark.parametrize("argv", [
    [],
    ["--api-key", "k", "--max-running-requests", "8", "--disable-radix-cache",
     "--heap-trim-interval", "2.5", "--speculative-algorithm", "NGRAM",
     "--speculative-num-draft-tokens", "6"],
    ["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 4}',
     "--schedule-policy", "lpm", "--chat-template", "chatml"],
])
def test_to_argv_is_what_parse_args_reads_back(argv):
    from specserve.launch.server_args import to_argv

    args = parse_args(argv)
    assert parse_args(to_argv(args)) == args


def test_an_option_on_by_default_turned_off_comes_back_as_its_no_flag():
    from specserve.launch.server_args import to_argv

    on = [f.name for f in dataclasses.fields(server_args_class()) if f.default is True]
    assert on, "no option is on by default"
    flag = on[0].replace("_", "-")
    args = parse_args([f"--no-{flag}"])
    assert to_argv(args) == [f"--no-{flag}"] and parse_args(to_argv(args)) == args


def test_a_replica_gets_the_users_flags_its_port_and_threads_not_the_launchers():
    from specserve.launch.data_parallel import replica_argv

    given = parse_args(["--dp-size", "2", "--host", "0.0.0.0", "--port", "8000", "--api-key",
                        "k", "--enable-metrics"])
    argv = replica_argv(given, threads=3, port=41234)
    assert argv[1:3] == ["-m", "launch_server"]
    assert parse_args(argv[3:]) == dataclasses.replace(
        given, dp_size=1, host="127.0.0.1", port=41234, num_threads=3)


def test_the_engine_refuses_dp_size():
    from specserve.launch.engine import Engine

    with pytest.raises(ValueError, match="--dp-size"):
        Engine(dp_size=2)
