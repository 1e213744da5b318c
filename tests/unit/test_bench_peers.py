"""`python -m benchmark.bench_peers --gguf FILE` on our side (`--skip-llamacpp`), for a tiny GGUF
of each Llama-family architecture: the file is converted and decoded in its own blocks, and a
chat dataset on a file without a chat template is a parser error before anything runs."""

from __future__ import annotations

import json

import pytest

from benchmark import bench_peers
from specserve.kernels import cpu
from tests.helpers.tiny_gguf import FAMILIES, write_family_gguf

# loaded before a test points the cache elsewhere: the extension stays the one built
OK, WHY = cpu.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"CPU extension unavailable: {WHY}")


@pytest.mark.parametrize("arch", FAMILIES)
def test_bench_peers_decodes_a_gguf_of_each_family(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"{arch}.gguf"
    write_family_gguf(path, arch, linear_type="Q8_0", embed_type="Q8_0")
    out = tmp_path / "peers.json"
    result = bench_peers.main(["--gguf", str(path), "--skip-llamacpp", "--skip-servers",
                               "--decode-tokens", "4", "--reps", "1", "--output", str(out)])
    assert result["decode"]["ours (auto)"]["tokens_per_s"] > 0
    assert json.loads(out.read_text())["gguf"] == str(path)


def test_a_chat_dataset_on_a_file_without_a_template_is_refused_up_front(tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "base.gguf"
    write_family_gguf(path, "qwen3", chat_template=False)
    with pytest.raises(SystemExit):
        bench_peers.main(["--gguf", str(path), "--skip-llamacpp", "--dataset", "rewrite",
                          "--output", str(tmp_path / "peers.json")])
    assert "ships no chat template" in capsys.readouterr().err
    assert not (tmp_path / "peers.json").exists()
