"""A GGUF file as STANDALONE's draft model (`--speculative-draft-model-path small.gguf`, the
counterpart of llama.cpp's `-md`), for each Llama-family GGUF architecture: converted as a
target file is, run in its own blocks on the CPU engine; the target's own file as the draft
is accepted at every drafted position and the output is plain decoding's; a file alike in
all but its vocabulary is refused at start-up with one line naming a token that differs."""

from __future__ import annotations

import shutil

import pytest

from specserve.kernels import cpu
from specserve.runtime.model_loader.default_model import resolve_model_path
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.drafters.standalone import DraftModelError
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.tiny_gguf import FAMILIES, write_family_gguf
from tests.unit.test_cpu_engine import runner
from tests.unit.test_gguf_families import MIXED
from tests.unit.test_scheduler import Harness, prompts, reference

OK, WHY = cpu.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"CPU extension unavailable: {WHY}")
NEW = 16


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """arch -> (target GGUF, its converted directory, a GGUF alike but for its vocabulary);
    conversions go to a cache of the test's own."""
    root = tmp_path_factory.mktemp("gguf_draft")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_CACHE_DIR", str(root / "cache"))
        out = {}
        for seed, arch in enumerate(FAMILIES):
            kw = dict(seed=seed, linear_type=MIXED, embed_type="Q8_0")
            target, other = root / f"{arch}.gguf", root / f"{arch}-other-vocab.gguf"
            write_family_gguf(target, arch, **kw)
            write_family_gguf(other, arch, shuffle_vocab=1, **kw)
            out[arch] = target, resolve_model_path(str(target), progress=False), other
        yield out


def spec_run(model_dir, draft_gguf, ps):
    tiny = (str(model_dir), runner(str(model_dir)))
    cfg = SpecConfig("STANDALONE", 4, num_steps=3, disable_adaptive=True,
                     draft_model_path=str(draft_gguf))
    drafter = create_drafter(cfg, tiny[1])
    h = Harness(tiny, num_draft_tokens=4, max_running_requests=4)
    h.worker = RunnerWorker(tiny[1], SpeculativeWorker(cfg, drafter, tiny[1]))
    h.sched.run_batch = h.worker.run
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=NEW)
    h.run()
    h.sched.check_no_leak()
    return h, drafter, reference(tiny, ps, ignore_eos=True, max_new_tokens=NEW)


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_targets_own_gguf_as_draft_is_accepted_everywhere(ggufs, arch, tmp_path):
    target, model_dir, _ = ggufs[arch]
    draft = tmp_path / "draft.gguf"  # another file holding the same model
    shutil.copy(target, draft)
    ps = prompts(8, seed=3)
    h, drafter, plain = spec_run(model_dir, draft, ps)
    assert drafter.draft.engine == "cpu"
    assert {"q4_0", "q8_0"} <= set(drafter.draft.weight_formats)  # the file's own blocks
    assert [h.outputs[f"r{i}"] for i in range(len(ps))] == plain
    t = h.sched.spec_totals
    assert 0 < t["spec_decode_num_draft_tokens"] == t["spec_decode_num_accepted_tokens"], t


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_gguf_draft_with_another_vocabulary_is_refused_at_start_up(ggufs, arch):
    _, model_dir, other = ggufs[arch]
    cfg = SpecConfig("STANDALONE", 4, num_steps=3, draft_model_path=str(other))
    with pytest.raises(DraftModelError, match="not vocabulary-compatible") as exc:
        create_drafter(cfg, runner(str(model_dir)))
    message = str(exc.value)
    assert "\n" not in message and "in the draft" in message and "in the target" in message
