"""`python -m specserve.speculative.train`: regenerate, capture, train and evaluate a draft for a
target: an EAGLE-3 head, a STANDALONE draft model (distilled from the target's layers), an
EARLY_EXIT exit adapter, Medusa heads or an MLPSpeculator.

    python -m specserve.speculative.train --target-model default --algorithm EAGLE3 \
        --data sharegpt --output results/eagle3 --num-prompts 4000 --regen-time-budget 2400 \
        --train-time-budget 2400
    python -m specserve.speculative.train --algorithm STANDALONE --draft-layers 4 \
        --output results/draft
    python -m specserve.speculative.train --algorithm EARLY_EXIT --exit-layer 7 \
        --output results/exit
    python -m specserve.speculative.train --algorithm MEDUSA --medusa-heads 3 \
        --output results/medusa
    python -m specserve.speculative.train --algorithm MLP_SPECULATOR --mlp-stages 3 \
        --output results/mlp

Every stage is resumable: rerun the same command (e.g. after a stop) and each stage
continues from what `--output` already holds. `--stages` picks a subset, in order.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

STAGES = ("regen", "capture", "train", "eval", "report")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specserve.speculative.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-model", default="default", help="target model dir (or 'default')")
    p.add_argument("--algorithm", default="EAGLE3",
                   choices=("EAGLE3", "EAGLE", "STANDALONE", "EARLY_EXIT", "MEDUSA",
                            "MLP_SPECULATOR"),
                   help="what to train: an EAGLE-3 head, a STANDALONE draft model, an EARLY_EXIT "
                   "exit adapter, MEDUSA heads, an MLP_SPECULATOR (EAGLE-1/2 heads load from "
                   "their published checkpoints)")
    p.add_argument("--data", default="sharegpt", choices=("sharegpt",),
                   help="prompt source (the ShareGPT train split)")
    p.add_argument("--output", required=True, help="run directory (data, checkpoints, head)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"comma-separated subset of {','.join(STAGES)}")
    g = p.add_argument_group("regen")
    g.add_argument("--num-prompts", type=int, default=4000)
    g.add_argument("--regen-max-new-tokens", type=int, default=256)
    g.add_argument("--regen-concurrency", type=int, default=16)
    g.add_argument("--regen-time-budget", type=float, default=None, help="seconds")
    g.add_argument("--regen-sampled-every", type=int, default=3,
                   help="every n-th prompt sampled at T=0.7, the rest greedy (0: all greedy)")
    g.add_argument("--teacher-forced", type=int, default=0, metavar="N",
                   help="also use the recorded ShareGPT answers of N more train prompts "
                   "(labels are still the target's distributions; no generation needed)")
    g = p.add_argument_group("capture")
    g.add_argument("--max-prompt-tokens", type=int, default=256,
                   help="prompt tail kept as context for each answer")
    g = p.add_argument_group("train")
    g.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="output vocabulary of the head / adapter, and of a draft model's "
                   "training loss: the most frequent answer tokens (<= 0: the full vocabulary)")
    g.add_argument("--draft-layers", type=int, default=4,
                   help="STANDALONE: target layers the draft keeps (spread evenly)")
    g.add_argument("--draft-layer-pick", default="spread", choices=("spread", "first"),
                   help="STANDALONE: which target layers initialise the draft: spread evenly "
                   "(the first, the last and between) or the first N")
    g.add_argument("--exit-layer", type=int, default=None,
                   help="EARLY_EXIT: the layer the adapter reads (default: a quarter of the "
                   "target's layers, EARLY_EXIT's serving default)")
    g.add_argument("--adapter-size", type=int, default=1024,
                   help="EARLY_EXIT: the adapter MLP's intermediate size")
    g.add_argument("--medusa-heads", type=int, default=3, help="MEDUSA: heads (draft depth)")
    g.add_argument("--medusa-layers", type=int, default=1, help="MEDUSA: ResBlocks per head")
    g.add_argument("--mlp-stages", type=int, default=3,
                   help="MLP_SPECULATOR: stages (n_predict: the deepest draft)")
    g.add_argument("--mlp-inner-dim", type=int, default=256,
                   help="MLP_SPECULATOR: the stages' width (inner_dim)")
    g.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps")
    g.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default 1e-3; 1e-4 for STANDALONE, whose layers "
                   "start trained)")
    g.add_argument("--epochs", type=float, default=2.0)
    g.add_argument("--batch-tokens", type=int, default=8192)
    g.add_argument("--train-time-budget", type=float, default=None, help="seconds")
    g.add_argument("--eval-every", type=int, default=100, help="optimizer steps")
    g.add_argument("--device", default="auto", help="training device: auto (cuda if present), "
                   "cpu or cuda")
    g = p.add_argument_group("eval")
    g.add_argument("--eval-prompts", type=int, default=24)
    g.add_argument("--eval-max-new-tokens", type=int, default=128)
    g.add_argument("--eval-snapshots", action="store_true",
                   help="also evaluate exported snapshots (the accept-vs-data curve)")
    g.add_argument("--eval-snapshots-every", type=int, default=1, metavar="N",
                   help="with --eval-snapshots: every N-th snapshot (the last one always)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        print(f"error: unknown stage(s) {bad}; choose from {STAGES}", file=sys.stderr)
        return 2
    if args.algorithm == "EAGLE":
        print("error: the trainer builds EAGLE-3 heads (--algorithm EAGLE3); EAGLE-1/2 heads "
              "load from their published checkpoints", file=sys.stderr)
        return 2
    out = Path(args.output)
    capture_layers = None  # EAGLE-3's
    if args.algorithm in ("STANDALONE", "MEDUSA", "MLP_SPECULATOR"):
        capture_layers = ()  # the final hidden state only
    elif args.algorithm == "EARLY_EXIT":
        from specserve.runtime.model_loader.config import ModelConfig
        from specserve.runtime.model_loader.default_model import resolve_model_path
        from specserve.speculative.train.distill import default_exit_layer

        n = ModelConfig.from_dir(str(resolve_model_path(
            None if args.target_model == "default" else args.target_model))).num_hidden_layers
        args.exit_layer = args.exit_layer or default_exit_layer(n)
        capture_layers = (args.exit_layer,)
    if args.lr is None:
        from specserve.speculative.train.distill import lr_default

        args.lr = lr_default(args.algorithm)
    if "regen" in stages:
        from specserve.speculative.train.regen import RegenConfig, regenerate

        regenerate(RegenConfig(
            target_model=args.target_model, output=str(out), num_prompts=args.num_prompts,
            max_new_tokens=args.regen_max_new_tokens, concurrency=args.regen_concurrency,
            time_budget_s=args.regen_time_budget, sampled_every=args.regen_sampled_every,
            seed=args.seed))
        if args.teacher_forced:
            from specserve.speculative.train.regen import write_teacher_forced

            write_teacher_forced(args.target_model, out, args.teacher_forced, seed=args.seed + 1)
    if "capture" in stages:
        from specserve.speculative.train.capture import CaptureConfig, capture

        capture(CaptureConfig(target_model=args.target_model, output=str(out),
                              max_prompt_tokens=args.max_prompt_tokens,
                              capture_layers=capture_layers))
    if "train" in stages:
        kw = dict(target_model=args.target_model, output=str(out),
                  draft_vocab_size=args.draft_vocab_size, steps=args.ttt_steps, lr=args.lr,
                  epochs=args.epochs, batch_tokens=args.batch_tokens,
                  time_budget_s=args.train_time_budget, eval_every=args.eval_every,
                  seed=args.seed, device=args.device)
        if args.algorithm == "EAGLE3":
            from specserve.speculative.train.trainer import TrainConfig, train

            train(TrainConfig(**kw))
        else:
            from specserve.speculative.train.distill import TRAINERS, DistillConfig

            TRAINERS[args.algorithm](DistillConfig(
                **kw, draft_layers=args.draft_layers, draft_layer_pick=args.draft_layer_pick,
                exit_layer=args.exit_layer, adapter_size=args.adapter_size,
                medusa_heads=args.medusa_heads, medusa_layers=args.medusa_layers,
                mlp_stages=args.mlp_stages, mlp_inner_dim=args.mlp_inner_dim)).train()
    if "eval" in stages:
        from specserve.speculative.train.evaluate import (
            CHAIN_EVAL,
            evaluate_head,
            evaluate_snapshots,
        )

        kw = dict(target_model=args.target_model, num_prompts=args.eval_prompts,
                  max_new_tokens=args.eval_max_new_tokens, seed=args.seed,
                  algorithm=args.algorithm)
        export = {"EAGLE3": "head", "STANDALONE": "draft", "EARLY_EXIT": "adapter",
                  "MEDUSA": "medusa", "MLP_SPECULATOR": "mlp_speculator"}[args.algorithm]
        if args.algorithm != "EAGLE3":
            kw["extra_server_args"] = CHAIN_EVAL
        if args.algorithm == "MEDUSA":  # the chain of the heads' top-1 drafts
            chain = [[0] * (d + 1) for d in range(args.medusa_heads)]
            kw["extra_server_args"] = {
                "speculative_medusa_choices": json.dumps(chain),
                "speculative_num_draft_tokens": args.medusa_heads + 1,
                "speculative_disable_adaptive": True}
        if args.algorithm == "MLP_SPECULATOR":  # the chain of every stage's top-1
            kw["extra_server_args"] = {
                **CHAIN_EVAL, "speculative_num_steps": args.mlp_stages,
                "speculative_num_draft_tokens": args.mlp_stages + 1}
        done = evaluate_snapshots(out, every=args.eval_snapshots_every, **kw) \
            if args.eval_snapshots else []
        # the final export is also the last snapshot: do not evaluate the same weights twice
        seen = json.loads((out / export / "config.json").read_text()).get(
            "specserve_training", {}).get("train_tokens_seen")
        res = next((r for r in done if r["train_tokens"] == seen), None) \
            or evaluate_head(out / export, **kw)
        (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res, indent=2))
    if "report" in stages:
        from specserve.speculative.train.report import plot_training

        print(f"wrote {plot_training(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
