"""`refstack serve --device cpu|cuda|auto` and `--kda-decode-kernel torch|triton`, over HTTP.

CPU tests run everywhere: `--device cuda` without a GPU is refused in one line, `auto`
falls back to the CPU and says so once, and knob combinations that cannot run are
refused in one line naming both knobs.  GPU tests (skipped without CUDA) serve the same
model on cuda and on the CPU and compare greedy completions.

How greedy tokens are compared across devices (``agreement``): cuBLAS sums in another
order than the CPU, so logits differ at fp32 rounding, and bench/engine_gate.py's rule
carries over: positions must be close at ``MIN_CLOSE`` (its 95%) of the positions, not
all, because the MoE router is a discrete choice that a 1e-6 difference can flip.  Over
HTTP the logits are not visible, so a position is "close" when both servers chose the
same token and its log-probability differs by at most ``LOGPROB_TOL``, or when they
chose different tokens at a near-tie: the reference's log-probabilities of the two
tokens are within ``NEAR_TIE``.  A sequence is compared up to its first divergence only
(past it the two contexts differ).  A wrong kernel diverges at a clear margin, or moves
the log-probabilities of every decoded position, and fails.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

# bench/engine_gate.py's share of positions that must agree (MIN_CLOSE there).
MIN_CLOSE = 0.95
# |logprob difference| of the same greedy token, in nats: fp32 reordering moves a
# logprob by ~1e-5; this leaves room for the difference to grow along a sequence.
LOGPROB_TOL = 2e-3
# Two tokens whose reference logprobs are this close are a tie either device may break.
NEAR_TIE = 2e-2
PROMPTS = [f"Prompt {i}: {'the quick brown fox ' * (i % 3)}jumps {i * 7}" for i in range(8)]
CPU_REFERENCE = ["--device", "cpu", "--cpu-kernels", "torch", "--dtype", "float32"]

# (token text, its logprob, {alternative text: logprob}) per generated token
Steps = list[tuple[str, float, dict[str, float]]]


def greedy(url: str, prompt: str, max_tokens: int) -> Steps:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 5}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))


def greedy_all(url: str, prompts: list[str], max_tokens: int) -> list[Steps]:
    """All prompts at once, so the server batches them (batched decode, padded prefill)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: greedy(url, p, max_tokens), prompts))


def agreement(reference: list[Steps], got: list[Steps]) -> tuple[float, list[str]]:
    """The share of compared positions that are close (see the module docstring), and a line per other one."""
    close = total = 0
    misses: list[str] = []
    for p, (ref, ours) in enumerate(zip(reference, got)):
        for i, ((r_tok, r_lp, r_top), (o_tok, o_lp, _)) in enumerate(zip(ref, ours)):
            total += 1
            if r_tok == o_tok:
                ok, what = abs(r_lp - o_lp) <= LOGPROB_TOL, f"logprob {r_lp:.6f} vs {o_lp:.6f}"
            else:
                margin = r_lp - r_top.get(o_tok, -math.inf)
                ok, what = margin <= NEAR_TIE, f"token {r_tok!r} vs {o_tok!r}, reference margin {margin:.2e}"
            close += ok
            if not ok:
                misses.append(f"prompt {p} position {i}: {what}")
            if r_tok != o_tok:
                break
    return close / max(total, 1), misses


def assert_agree(reference: list[Steps], got: list[Steps]) -> None:
    share, misses = agreement(reference, got)
    assert share >= MIN_CLOSE, f"{share:.1%} of positions close (need {MIN_CLOSE:.0%}): " + "; ".join(misses)


def refstack(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "refstack.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, check=False)


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode != 0 and "refstack serving" not in r.stdout, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refstack: error: "), r.stderr
    return lines[0]


# ---- CPU: refusals, fallback, knob checks ------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_cuda_without_a_gpu_is_refused_in_one_line() -> None:
    line = one_error_line(refstack("serve", "--device", "cuda"))
    assert "--device cuda: no CUDA device is visible" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_auto_falls_back_to_cpu_and_says_so_once(refstack_server_factory: Callable[..., Any]) -> None:
    server = refstack_server_factory(args=["--device", "auto"])
    engine = httpx.get(server.url + "/debug/engine", timeout=10).json()
    assert (engine["device"], engine["config"]["device"]) == ("cpu", "auto")
    assert greedy(server.url, "hello", 3)
    said = [line for line in server.log().splitlines() if "--device auto" in line]
    assert said == ["--device auto: no CUDA device is visible; running on cpu"], server.log()


def test_knobs_list_device_and_kda_decode_kernel() -> None:
    r = refstack("knobs", "--json")
    assert r.returncode == 0, r.stderr
    listed = {k["name"]: k for k in json.loads(r.stdout)}
    assert listed["device"]["domain"] == {"choices": ["cpu", "cuda", "auto"]} and listed["device"]["default"] == "cpu"
    assert listed["kda_decode_kernel"]["domain"] == {"choices": ["torch", "triton"]}
    assert listed["kda_decode_kernel"]["default"] == "torch"


@pytest.mark.parametrize(("args", "names"), [
    (["--device", "gpu"], ["--device"]),
    (["--kda-decode-kernel", "cuda"], ["--kda-decode-kernel"]),
    (["--device", "cuda", "--cpu-kernels", "native"], ["--cpu-kernels native", "--device cuda"]),
    (["--device", "cuda", "--disagg", "true"], ["--disagg", "--device cuda"]),
    (["--device", "cuda", "--ep-link-gbps", "5"], ["--ep-link-gbps 5", "--device cuda"]),
    (["--kda-decode-kernel", "triton", "--cpu-kernels", "native"],
     ["--kda-decode-kernel triton", "--cpu-kernels native"]),
    (["--kda-decode-kernel", "triton", "--device", "cpu"], ["--kda-decode-kernel triton", "--device cpu"]),
])
def test_combinations_that_cannot_run_are_refused_in_one_line(args: list[str], names: list[str]) -> None:
    line = one_error_line(refstack("serve", *args))
    assert all(name in line for name in names), line


def test_triton_that_cannot_be_imported_is_refused_in_one_line(tmp_path: Path) -> None:
    """A `triton` that fails to import (and the interpreter, so the device check passes)."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ImportError('triton hidden by the test')\n")
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    line = one_error_line(refstack("serve", "--kda-decode-kernel", "triton", "--device", "cpu", env=env))
    assert "--kda-decode-kernel triton with --device cpu: cannot import the Triton KDA kernel" in line, line


def test_placement_resolves_the_kernel_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    from refstack.engine import EngineConfig
    from refstack.engine.device import Placement, resolve_placement

    assert resolve_placement(EngineConfig()) == Placement("cpu", "auto", "torch")
    # The Triton decode plugs into torch's KDA path, so "auto" kernels mean torch there.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "refstack.kernels.kda_decode", type(sys)("kda_decode_stand_in"))
    assert resolve_placement(EngineConfig(kda_decode_kernel="triton")) == Placement("cpu", "torch", "triton")


# ---- GPU: the same model on cuda and on the CPU ------------------------------------------

@pytest.fixture(scope="module")
def cpu_reference(refstack_module_server_factory: Callable[..., Any]) -> list[Steps]:
    server = refstack_module_server_factory(args=CPU_REFERENCE)
    return greedy_all(server.url, PROMPTS, 24)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kda", ["torch", "triton"])
def test_cuda_greedy_matches_the_cpu(kda: str, cpu_reference: list[Steps],
                                     refstack_module_server_factory: Callable[..., Any]) -> None:
    """Both KDA decode kernels on cuda against the CPU's torch path (the comparison rule is
    the module docstring's)."""
    if kda == "triton" and importlib.util.find_spec("refstack.kernels.kda_decode") is None:
        pytest.skip("refstack.kernels.kda_decode (the Triton KDA decode kernel) is not there yet")
    server = refstack_module_server_factory(args=["--device", "cuda", "--dtype", "float32",
                                                  "--kda-decode-kernel", kda])
    engine = httpx.get(server.url + "/debug/engine", timeout=10).json()
    assert (engine["device"], engine["native_kernels"], engine["config"]["kda_decode_kernel"]) == ("cuda", False, kda)
    assert_agree(cpu_reference, greedy_all(server.url, PROMPTS, 24))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_picks_cuda_and_says_so_once(refstack_server_factory: Callable[..., Any]) -> None:
    server = refstack_server_factory(args=["--device", "auto"])
    engine = httpx.get(server.url + "/debug/engine", timeout=10).json()
    assert (engine["device"], engine["native_kernels"], engine["dtype"]) == ("cuda", False, "float32")
    assert greedy(server.url, "hello", 3)
    said = [line for line in server.log().splitlines() if "--device auto" in line]
    assert len(said) == 1 and said[0].startswith("--device auto: running on cuda"), server.log()
