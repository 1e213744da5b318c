"""Adding an algorithm is one file: this module declares a toy algorithm (its options, its
default tree size, its drafter) and serves it end to end — the generated flag parses into
ServerArgs, shows in `--help` under its own group, reaches the drafter in the model-runner
process through `Engine(**kwargs)`, and greedy output equals plain decoding. No other file
names TOY; the spawned processes import this module through SPECSERVE_PLUGINS."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from specserve.speculative.base import ALGORITHMS, Drafter, RunnerReq, register_algorithm
from specserve.speculative.options import SpecOptions, option
from specserve.speculative.tree import DraftTree


@dataclass(frozen=True)
class ToyOptions(SpecOptions):
    toy_lookback: int = option(3, "TOY: draft a copy of the tokens that followed the last "
                               "occurrence of the root, this many tokens long at most")


if "TOY" not in ALGORITHMS:  # imported once by pytest and once per spawned process

    @register_algorithm("TOY")
    class ToyDrafter(Drafter):
        options = ToyOptions
        default_num_draft_tokens = {"cpu": 4, "torch": 4}
        vllm_methods = ("toy",)

        def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
            trees = []
            for r in reqs:
                root, drafts = r.tokens[-1], []
                for i in range(len(r.tokens) - 2, -1, -1):
                    if r.tokens[i] == root:
                        drafts = r.tokens[i + 1 : i + 1 + self.cfg.toy_lookback]
                        break
                trees.append(DraftTree.chain(root, drafts[: max(r.budget - 1, 0)]))
            return trees


def test_a_toy_algorithm_is_served_through_its_own_generated_flag(tmp_path, monkeypatch):
    from specserve.launch.engine import Engine
    from specserve.launch.server_args import build_parser, parse_args
    from tests.helpers.tiny_models import write_tiny_model
    from tests.unit.test_scheduler import prompts

    model = write_tiny_model(tmp_path / "m", "llama", seed=3)
    help_text = build_parser().format_help()
    assert "--speculative-toy-lookback" in help_text and "\nTOY:\n" in help_text
    # fixed tree sizes: whether drafting pays on a tiny model is the adaptive budget's call
    # (timing), and this test is about the plugin's wiring, so it must draft every step
    args = parse_args(["--model-path", str(model), "--speculative-algorithm", "toy",
                       "--speculative-toy-lookback", "2", "--speculative-disable-adaptive",
                       "--log-level", "warning"])
    assert args.speculative_toy_lookback == 2
    resolved = args.resolve()
    assert (resolved.speculative_algorithm, resolved.speculative_num_draft_tokens) == ("TOY", 4)
    with pytest.raises(ValueError, match="toy-lookback applies to --speculative-algorithm TOY"):
        dataclasses.replace(args, speculative_algorithm="NGRAM").resolve()
    monkeypatch.setenv("SPECSERVE_PLUGINS", __name__)
    ps = [p * 3 for p in prompts(6, seed=4)]  # repeats: the toy's copies get accepted
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(**dataclasses.asdict(args)) as spec:
        outs = [o["output_ids"] for o in spec.generate(input_ids=ps, sampling_params=params)]
        info = spec.server_info()
        # the runner timed its curve once the scheduler and the front end had loaded
        # (runner_process.StartupQuiet)
        assert "measured at start-up" in spec.tm.ready_info["verify_cost"]["source"]
    with Engine(model_path=str(model), log_level="warning") as plain:
        ref = [o["output_ids"] for o in plain.generate(input_ids=ps, sampling_params=params)]
    assert outs == ref
    assert info["spec_verify_steps"] > 0 and info["spec_decode_num_draft_tokens"] > 0
