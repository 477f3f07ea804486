"""``--tokenizer hf:PATH`` / ``tokenizer:``: prompt lengths in the server's tokens, checked first.

Tokenizers are trained here on the repository's Markdown (tiny_llama.py), nothing is
downloaded; the server is the fake OpenAI server in a subprocess, serving vLLM's
``/tokenize`` with a tokenizer folder of its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")

from infra_agent.cli.main import app
from infra_agent.errors import ConfigError, TargetError
from infra_agent.serving.datasets import HFTokenizer, load_tokenizer, random_requests
from infra_agent.serving.runner import run_benchmark
from infra_agent.workspace import load_workspace
from infra_agent.workspace.models import Scenario

runner = CliRunner()
_TINY = Path(__file__).with_name("tiny_llama.py")


def write_tokenizer(out: Path, vocab: int) -> Path:
    subprocess.run([sys.executable, str(_TINY), str(out), "--tokenizer-only", "--vocab", str(vocab)], check=True,
                   capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tok")
    return write_tokenizer(root / "a", vocab=1024), write_tokenizer(root / "b", vocab=700)


def _requested(url: str) -> float:
    """max_tokens the fake server was asked for so far: 0 means no generation request."""
    for line in httpx.get(url + "/metrics", trust_env=False).text.splitlines():
        if line.startswith("fake_requested_tokens_total"):
            return float(line.split()[-1])
    return 0.0


def _scenario(**kw: object) -> Scenario:
    return Scenario.model_validate({"dataset": {"kind": "random", "input_len": 24, "output_len": 3}, "num_requests": 4, **kw})


def test_random_prompts_have_the_asked_length_in_the_tokenizers_tokens(tokenizers) -> None:  # type: ignore[no-untyped-def]
    tok = load_tokenizer(f"hf:{tokenizers[0]}")
    assert isinstance(tok, HFTokenizer) and tok.spec == f"hf:{tokenizers[0]}"
    for r in random_requests(8, 40, 4, range_ratio=0.25, seed=3, tokenizer=tok):
        assert isinstance(r.prompt, str)
        # As vLLM's random dataset: the server sees input_len tokens, its BOS included.
        assert r.prompt_len == tok.count_with_specials(r.prompt) and 30 <= r.prompt_len <= 50


def test_tokenizer_matching_the_servers_tokenize(fake_server_factory, tokenizers) -> None:  # type: ignore[no-untyped-def]
    srv = fake_server_factory("--tokenizer", str(tokenizers[0]))
    res = run_benchmark(srv.url, _scenario(), progress=False, tokenizer=load_tokenizer(f"hf:{tokenizers[0]}"))
    assert res["completed"] == 4 and res["tokenizer_id"] == f"hf:{tokenizers[0]}"
    assert res["tokenizer_check"] == "ids equal the server's /tokenize"


def test_tokenizer_that_does_not_fit_is_refused_before_any_request(fake_server_factory, tokenizers) -> None:  # type: ignore[no-untyped-def]
    srv = fake_server_factory("--tokenizer", str(tokenizers[1]))
    with pytest.raises(TargetError, match=r"does not fit the server.*/tokenize") as err:
        run_benchmark(srv.url, _scenario(), progress=False, tokenizer=load_tokenizer(f"hf:{tokenizers[0]}"))
    assert f"hf:{tokenizers[0]}" in str(err.value) and "first difference at position" in str(err.value)
    assert _requested(srv.url) == 0  # not one generation request was sent


def test_without_tokenize_the_check_requests_usage_decides(fake_server_factory, tokenizers) -> None:  # type: ignore[no-untyped-def]
    # This server has no /tokenize and counts prompts in bytes: the check request's
    # usage.prompt_tokens disagrees with the tokenizer, so the window never opens.
    srv = fake_server_factory()
    with pytest.raises(TargetError, match=r"usage\.prompt_tokens=\d+ .*no /tokenize"):
        run_benchmark(srv.url, _scenario(), progress=False, tokenizer=load_tokenizer(f"hf:{tokenizers[0]}"))
    assert _requested(srv.url) == 2  # only the 2-token check request


def test_cli_tokenizer_errors_name_the_flag_and_path(fake_server_factory, tmp_path: Path, tokenizers) -> None:  # type: ignore[no-untyped-def]
    srv = fake_server_factory()
    missing = tmp_path / "no-such-tokenizer"
    res = runner.invoke(app, ["bench", srv.url, "--tokenizer", f"hf:{missing}", "--num-requests", "2", "--no-progress"])
    assert res.exit_code == 2 and "--tokenizer" in res.output and "no such folder" in res.output and str(missing) in res.output
    res = runner.invoke(app, ["bench", srv.url, "--tokenizer", str(tokenizers[0]), "--json", "--no-progress"])
    assert res.exit_code == 2 and "'byte' or 'hf:<local tokenizer folder>'" in json.loads(res.stdout)["message"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="none of them in it"):
        load_tokenizer(f"hf:{empty}")
    assert _requested(srv.url) == 0


def test_cli_tokenizer_matching_server(fake_server_factory, tokenizers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = fake_server_factory("--tokenizer", str(tokenizers[0]))
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", srv.url, "--tokenizer", f"hf:{tokenizers[0]}", "--num-requests", "3",
                              "--input-len", "20", "--output-len", "2", "--no-progress", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "prompt lengths counted by" in res.output
    data = json.loads(out.read_text())
    assert data["tokenizer_id"] == f"hf:{tokenizers[0]}" and data["tokenizer_check"].startswith("ids equal")


def test_scenario_tokenizer_resolves_against_the_workspace(tmp_path: Path, tokenizers) -> None:  # type: ignore[no-untyped-def]
    shutil.copytree(tokenizers[0], tmp_path / "tok")
    text = ("name: t\ntarget: {kind: endpoint, url: 'http://127.0.0.1:9'}\n"
            "scenarios:\n  s:\n    dataset: {kind: random, input_len: 8, output_len: 2}\n    num_requests: 2\n"
            "    tokenizer: hf:TOK\n")
    (tmp_path / "infra-agent.yaml").write_text(text.replace("TOK", "tok"))
    ws = load_workspace(tmp_path)
    assert ws.scenario("s").tokenizer == f"hf:{(tmp_path / 'tok').resolve()}"
    (tmp_path / "infra-agent.yaml").write_text(text.replace("TOK", "missing-tok"))
    with pytest.raises(ConfigError, match=r"scenarios\.s\.tokenizer: expected hf:<an existing tokenizer folder>"):
        load_workspace(tmp_path)
