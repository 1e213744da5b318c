"""End to end through scheduler + runner worker + speculative worker on a 12-token target: the
sampled tokens follow the target's processed distribution (penalties, temperature, top-k,
top-p) at every verify position, for a deterministic drafter (ONE_HOT), a drafter with q (IID)
and seeded requests (Gumbel-max draws from (seed, position) noise). Each arm has a negative
control: the same run with a known bug injected into the verification path must be rejected by
the same statistic (a verifier that forgets the residual; seeded noise that ignores the
position), so the test is known to be able to fail."""

from __future__ import annotations

import itertools

import pytest
import torch

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.runtime.sampling import seeded as seeded_noise
from specserve.runtime.sampling.penalties import RowHistory, apply_penalties
from specserve.runtime.sampling.sampler import SamplingBatchInfo, process_logits
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.verify_cost import VerifyCost
from specserve.speculative.base import Drafter, RunnerReq, SpecConfig
from specserve.speculative.drafters.lookahead import LookaheadDrafter
from specserve.speculative.drafters.suffix import SuffixDrafter
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import QMode, VerifyResult, sample_from
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.stats import goodness_of_fit
from tests.helpers.tiny_models import write_tiny_model
from tests.unit.test_scheduler import Harness

VOCAB = 12
PROMPT = [3, 7, 1, 9]
# penalties make every verify node's distribution depend on its path
PARAMS = {"temperature": 1.3, "top_k": 6, "top_p": 0.95, "repetition_penalty": 1.4,
          "presence_penalty": 0.3}
TOKENS = 4  # per request: the prefill's draw, then verify positions
SAMPLES = 3000


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    d = write_tiny_model(tmp_path_factory.mktemp("tv") / "m", "llama", seed=11,
                         vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    runner = ModelRunner(RunnerConfig(str(d), "cpu", "float32", max_total_tokens=60000))
    return d, runner


def next_dists(runner, seqs: list[list[int]], params: dict = PARAMS,
               allowed=None) -> torch.Tensor:
    """Processed next-token distributions [len(seqs), V] after PROMPT + each continuation;
    `allowed(last token or None)` lists the tokens a grammar allows there (masked first, as
    the runtime does)."""
    full = [PROMPT + s for s in seqs]
    slots = [torch.arange(1, len(f) + 1) + 16 * i for i, f in enumerate(full)]
    logits = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, full, slots,
                                               [0] * len(full))).logits
    if allowed is not None:
        logits = logits.clone()
        for i, s in enumerate(seqs):
            ok = torch.zeros(VOCAB, dtype=torch.bool)
            ok[allowed(s[-1] if s else None)] = True
            logits[i, ~ok] = float("-inf")
    info = SamplingBatchInfo.from_params([SamplingParams(**params)] * len(seqs), VOCAB)
    logits = apply_penalties(logits, info, [PROMPT] * len(seqs), seqs)
    return process_logits(logits, info).double()


def pair_joints(runner, params: dict = PARAMS, tokens: int = TOKENS,
                allowed=None) -> list[torch.Tensor]:
    """Exact p(t_k, t_k+1) [V, V] for k = 1 .. tokens - 1 under the processed distribution
    (masked by `allowed`, as `next_dists`)."""
    prefixes = {(): torch.tensor(1.0, dtype=torch.float64)}  # continuation → its probability
    joints = []
    for k in range(tokens):
        keys = [c for c, pr in prefixes.items() if pr > 0]
        dists = next_dists(runner, [list(c) for c in keys], params, allowed)  # [keys, V]
        nxt = {}
        pair = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        for c, d in zip(keys, dists):
            for t in torch.nonzero(d).flatten().tolist():
                pr = prefixes[c] * d[t]
                nxt[c + (t,)] = pr
                if k >= 1:
                    pair[c[-1], t] += pr
        if k >= 1:
            joints.append(pair)
        prefixes = nxt
    return joints


@pytest.fixture(scope="module")
def joints(tiny_vocab):
    return pair_joints(tiny_vocab[1])


class SkewedTreeDrafter(Drafter):
    """Deterministic drafter (ONE_HOT): a fixed function of the context picks the tokens — the
    root gets 2 children, each continued as a chain. Not uniform, so a verifier that forgets
    the residual is visible (uniformly random drafts would average that bug away)."""

    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        out = []
        for r in reqs:
            n = r.budget
            tokens, parents = [r.tokens[-1]], [-1]
            for i in range(1, n):
                parent = 0 if i <= 2 else i - 2  # two chains hanging off the root
                prev = tokens[parent]
                tokens.append((prev * 5 + 3 + (i % 2) + len(r.tokens)) % VOCAB)
                parents.append(parent)
            out.append(DraftTree.from_parents(tokens, parents))
        return out


class IIDDrafter(Drafter):
    """Probabilistic drafter: siblings drawn i.i.d. from a fixed skewed q (IID mode, q used)."""

    q_mode = QMode.IID

    def __init__(self, cfg, runner):
        super().__init__(cfg, runner)
        self.gen = torch.Generator().manual_seed(1)
        q = torch.rand(VOCAB, generator=self.gen) ** 3
        self.q = q / q.sum()

    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        out = []
        for r in reqs:
            # root with 2 i.i.d. children, each with 1 child of its own: depth 2
            toks = torch.multinomial(self.q, 4, replacement=True, generator=self.gen).tolist()
            tokens = [r.tokens[-1], *toks]
            parents = [-1, 0, 0, 1, 2]
            probs = self.q.expand(5, VOCAB).clone()
            out.append(DraftTree.from_parents(tokens, parents, draft_probs=probs))
        return out


def forgetful_verify(tree: DraftTree, target_probs: torch.Tensor, uniforms: torch.Tensor,
                     *, q_mode=QMode.ONE_HOT, **_) -> VerifyResult:
    """BUG on purpose (negative control): verify_stochastic without the residual — a rejected
    sibling leaves the target's p as it was, and the final draw comes from the original p."""
    coins, tokens = uniforms.tolist(), tree.tokens.tolist()
    nodes, accepted, node = [0], [], 0
    while True:
        p = target_probs[node].double()
        q = None if q_mode == QMode.ONE_HOT else tree.draft_probs[node].double()
        nxt = -1
        for c in tree.children(node):
            x = tokens[c]
            ratio = float(p[x]) if q is None else float(p[x] / q[x]) if q[x] > 0 else 0.0
            if coins[c] < min(1.0, ratio):
                nxt = c
                break
        if nxt < 0:
            return VerifyResult(nodes, accepted, sample_from(p, coins[0]))
        nodes.append(nxt)
        accepted.append(tokens[nxt])
        node = nxt


def positionless_row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """BUG on purpose (negative control): every position of a seed gets the same noise."""
    return seeded_noise._mix(seeded_noise._mix(seeds.to(torch.int64)))


def pathless_history(request: torch.Tensor, extra_rows: torch.Tensor,
                     extra_tokens: torch.Tensor) -> RowHistory:
    """BUG on purpose (negative control): a tree node's penalties forget its path."""
    return RowHistory(request, extra_rows[:0], extra_tokens[:0])


def run_samples(tiny_vocab, drafter_cls, *, seeded: bool, budget: int = 5,
                max_new_tokens: int = TOKENS, params: dict = PARAMS) -> tuple[torch.Tensor, dict]:
    """SAMPLES requests of PROMPT through the scheduler with speculation: outputs [n, tokens]
    and the scheduler's info."""
    runner = tiny_vocab[1]
    torch.manual_seed(0)  # unseeded requests draw from the global RNG: reproducible runs
    h = Harness(tiny_vocab, capacity=60000, num_draft_tokens=budget, max_running_requests=512,
                chunked_prefill_size=4096)
    cfg = SpecConfig("TEST", budget, disable_adaptive=True)
    # rows free (a GPU-like verify-cost curve): a drafter that trims its trees by cost (SUFFIX)
    # keeps them whole in a batch of hundreds, so deep drafts get tested
    free_rows = VerifyCost((1, 4096), (1.0, 1.0), "free rows (test)")
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter_cls(cfg, runner), runner,
                                                      free_rows))
    h.sched.run_batch = h.worker.run
    h.sched.stop.eos = set()
    for i in range(SAMPLES):
        seed = {"seed": i} if seeded else {}
        h.submit(f"s{i}", PROMPT, max_new_tokens=max_new_tokens, **seed, **params)
    h.run()
    h.sched.check_no_leak()
    outs = torch.tensor([h.outputs[f"s{i}"] for i in range(SAMPLES)])  # [n, tokens]
    return outs, h.sched.info()


def pair_fits(outs: torch.Tensor, joints: list[torch.Tensor]) -> list:
    fits = []
    for k, joint in enumerate(joints):
        counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        counts.index_put_((outs[:, k], outs[:, k + 1]),
                          torch.ones(outs.shape[0], dtype=torch.float64), accumulate=True)
        fits.append(goodness_of_fit(counts, joint))
    return fits


ARMS = {"one_hot": (SkewedTreeDrafter, False), "iid": (IIDDrafter, False),
        "seeded": (SkewedTreeDrafter, True),
        # a real drafter: suffix trees over the outputs sampled so far (deterministic, ONE_HOT)
        "suffix": (lambda cfg, runner: SuffixDrafter(SpecConfig(
            "SUFFIX", cfg.num_draft_tokens, disable_adaptive=True, suffix_min_token_prob=0.02,
            suffix_max_spec_factor=2.0), runner), False),
        # Jacobi window + n-gram pool: a deterministic tree of two branches (ONE_HOT)
        "lookahead": (lambda cfg, runner: LookaheadDrafter(SpecConfig(
            "LOOKAHEAD", cfg.num_draft_tokens, disable_adaptive=True, lookahead_window=2,
            lookahead_ngram=3, lookahead_guess_set=1), runner), False),
        # Medusa heads (random, tied to the target's LM head): a static top-k tree (ONE_HOT)
        "medusa": (lambda cfg, runner: medusa_drafter(cfg, runner), False)}


def medusa_drafter(cfg, runner):
    import tempfile
    from pathlib import Path

    from specserve.speculative.drafters.medusa import MedusaDrafter
    from specserve.speculative.models.medusa import MedusaHeads, save_medusa

    mc = runner.model_config
    torch.manual_seed(5)
    heads = MedusaHeads(2, 1, mc.hidden_size, mc.vocab_size, tied=True)
    for p in heads.parameters():
        p.data.normal_(0, 0.05)
    path = save_medusa(heads, Path(tempfile.mkdtemp()) / "medusa")
    return MedusaDrafter(SpecConfig("MEDUSA", cfg.num_draft_tokens, disable_adaptive=True,
                                    draft_model_path=str(path),
                                    medusa_choices="[[0], [1], [0, 0], [1, 0]]"), runner)


@pytest.mark.parametrize("arm", list(ARMS))
def test_speculative_sampling_matches_target_at_every_position(tiny_vocab, joints, arm):
    drafter_cls, seeded = ARMS[arm]
    outs, info = run_samples(tiny_vocab, drafter_cls, seeded=seeded)
    per_pos = info["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) >= 2 and per_pos[1] > 0, f"no depth-2 draft accepted: {per_pos}"
    for k, fit in enumerate(pair_fits(outs, joints)):
        assert fit.passed, f"tokens {k + 1},{k + 2}: {fit}"


_WORKER, _SEEDED = "specserve.speculative.worker", "specserve.runtime.sampling.seeded"
NEGATIVE_CONTROLS = {
    "one_hot_forgets_residual": (f"{_WORKER}.verify_stochastic", forgetful_verify),
    "iid_forgets_residual": (f"{_WORKER}.verify_stochastic", forgetful_verify),
    "seeded_noise_ignores_position": (f"{_SEEDED}.row_keys", positionless_row_keys),
    "one_hot_penalties_ignore_path": (f"{_WORKER}.RowHistory", pathless_history),
}


@pytest.mark.parametrize("bug", list(NEGATIVE_CONTROLS))
def test_negative_control_a_known_bug_is_rejected(tiny_vocab, joints, bug, monkeypatch):
    target, buggy = NEGATIVE_CONTROLS[bug]
    monkeypatch.setattr(target, buggy)
    drafter_cls, seeded = ARMS[next(arm for arm in ARMS if bug.startswith(arm))]
    outs, _ = run_samples(tiny_vocab, drafter_cls, seeded=seeded)
    fits = pair_fits(outs, joints)
    assert not all(f.passed for f in fits), "the injected bug went unnoticed: " + "; ".join(
        map(str, fits))


def test_a_sample_in_a_zero_probability_cell_fails_outright():
    probs = torch.tensor([0.5, 0.5, 0.0])
    assert goodness_of_fit(torch.tensor([500.0, 500.0, 0.0]), probs).passed
    fit = goodness_of_fit(torch.tensor([500.0, 499.0, 1.0]), probs)
    assert not fit.passed and fit.zero_cell_samples == 1 and fit.stat < fit.critical


def test_pair_joints_are_distributions(joints):
    for j in joints:
        assert abs(float(j.sum()) - 1.0) < 1e-6
    # consecutive pairs share a marginal: sum over t_k+1 of one = sum over t_k of the next
    for a, b in itertools.pairwise(joints):
        torch.testing.assert_close(a.sum(0), b.sum(1))
