"""The quality probe: teacher-forced logprobs of a candidate server against a baseline.

Real refstack servers on loopback: two of one configuration agree exactly (KL 0, top-1
agreement 1); a bf16 LM head or another weight seed is measurably different; a server
launched from a workspace with a changed knob is located at that knob.  A stub server
without echo support gives a ``no_logprobs`` finding and no metrics.  Bad configs are
ConfigErrors naming the field, and criteria on the probe's metrics are gates.
"""

from __future__ import annotations

import math
import random
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from fastapi import (  # module level: the stub's annotations are resolved here
    FastAPI,
    Request,
)
from fastapi.responses import JSONResponse

from infra_agent.errors import ConfigError
from infra_agent.feedback import Feedback, Location, Tier
from infra_agent.judge.gates import criteria_gates
from infra_agent.probes.base import ProbeContext, get_probe, registered_probes
from infra_agent.probes.quality import QualityProbe, load_prompts
from infra_agent.probes.quality_metrics import Unusable, bucket_kl, parse_echo
from infra_agent.vocabulary import FindingKind
from infra_agent.workspace import load_workspace

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "quantization"
FP32 = ["--dtype", "float32"]  # the same GEMMs on every machine
FEW = {"num_prompts": 4}  # enough positions (~1400) to see a difference, and quick


@pytest.fixture(scope="module")
def servers(refstack_module_server_factory: Any) -> dict[str, Any]:
    start = refstack_module_server_factory
    return {"a": start(FP32), "a2": start(FP32), "bf16": start([*FP32, "--lm-head-precision", "bf16"]),
            "seed": start([*FP32, "--seed", "1"])}


def _run(tmp_path: Path, config: dict[str, Any], **ctx: Any) -> Feedback:
    return QualityProbe().execute(config, ProbeContext(workdir=tmp_path / "quality", progress=False, **ctx))


def _values(fb: Feedback, name: str) -> list[float]:
    return fb.measurement(name).samples


# ---- the registry, the metrics' names, the numbers without a server ----

def test_registered_as_a_check_that_measures_the_quality_metrics() -> None:
    assert registered_probes()["quality"] == "infra_agent.probes.quality:QualityProbe"
    cls = get_probe("quality")
    assert cls is QualityProbe and cls.tier() == Tier.check
    for metric in ("kl_div", "top1_agreement", "logprob_err_p50", "logprob_err_p99", "logprob_err_p99.9", "perplexity",
                   "perplexity_ratio"):
        assert cls.measures(metric), metric
    assert not cls.measures("output_throughput") and not cls.measures("logprob_err_p101")
    assert cls.covers(Location(component="model.lm_head", precision="bf16"))
    assert cls.covers(Location(component="engine.cache"))
    assert not cls.covers(Location(component="client"))
    prompts = load_prompts()
    assert len(prompts) >= 8 and all(p.isascii() and 0 < len(p) < 400 for p in prompts)


def test_bucketed_kl_is_a_lower_bound_of_the_true_kl() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = 40
        p = [rng.random() ** 3 for _ in range(n)]
        q = [x * math.exp(rng.gauss(0, 0.5)) for x in p]
        p = [x / sum(p) for x in p]
        q = [x / sum(q) for x in q]
        true = sum(a * math.log(a / b) for a, b in zip(p, q))

        def top(d: list[float], k: int = 5) -> dict[str, float]:
            best = sorted(range(len(d)), key=lambda i: -d[i])[:k]
            return {str(i): math.log(d[i]) for i in best}

        tp, tq = top(p), top(q)
        actual = str(rng.randrange(n))  # the echoed token is reported on both sides
        tp.setdefault(actual, math.log(p[int(actual)]))
        tq.setdefault(actual, math.log(q[int(actual)]))
        got = bucket_kl(tp, tq)
        assert 0.0 <= got <= true + 1e-12
    same = {"a": math.log(0.5), "b": math.log(0.25)}
    assert bucket_kl(same, same) == 0.0


def test_an_answer_without_prompt_logprobs_is_unusable() -> None:
    ok = {"choices": [{"logprobs": {"tokens": ["<s>", "a", "b"], "token_logprobs": [None, -1.0, -2.0],
                                    "top_logprobs": [None, {"a": -1.0, "c": -0.5}, None]}}],
          "usage": {"prompt_tokens": 3}}
    got = parse_echo(ok)
    assert got.tokens == ["a", "b"] and got.top[1] == {"b": -2.0}
    for bad, why in [({"choices": [{"text": "x"}]}, "no logprobs"),
                     ({"choices": [{"logprobs": None}]}, "no logprobs"),
                     ({"choices": [{"logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0],
                                                 "top_logprobs": [{}, {}]}}]}, "echo ignored")]:
        with pytest.raises(Unusable):
            parse_echo(bad)


@pytest.mark.parametrize(("config", "field"), [
    ({"logprobs": 0}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"percentiles": [50, 0]}, "percentiles"),
    ({"baseline_url": "localhost:8000"}, "baseline_url"),
    ({"max_tokens": 2}, "max_tokens"),
    ({"min_top1_agreement": 1.5}, "min_top1_agreement"),
    ({"baseline": "http://x"}, "baseline"),
])
def test_a_bad_config_is_a_config_error_naming_the_field(tmp_path: Path, config: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        _run(tmp_path, config)
    assert err.value.field is not None and field in err.value.field, str(err.value)


# ---- real servers ----

def test_one_configuration_twice_agrees_exactly(tmp_path: Path, servers: dict[str, Any]) -> None:
    fb = _run(tmp_path, {**FEW, "baseline_url": servers["a"].url, "candidate_url": servers["a2"].url})
    assert fb.ok, fb.error
    assert _values(fb, "kl_div") == [0.0] * 4 and _values(fb, "top1_agreement") == [1.0] * 4
    assert _values(fb, "logprob_err_p99") == [0.0] * 4 and _values(fb, "perplexity_ratio") == [1.0] * 4
    pooled = fb.meta["quality"]["pooled"]
    assert pooled["kl_div"] == 0.0 and pooled["top1_agreement"] == 1.0 and pooled["positions"] > 1000
    assert pooled["perplexity"] == pytest.approx(pooled["baseline_perplexity"]) and pooled["perplexity"] > 1
    assert fb.findings[0].kind == FindingKind.LOGPROB_DIVERGENCE and fb.findings[0].severity == "info"
    assert any(a.kind == "result" for a in fb.artifacts)


def test_a_bf16_lm_head_and_another_seed_are_measurable(tmp_path: Path, servers: dict[str, Any]) -> None:
    # The candidate as a running target (how the executor hands one over), the baseline by URL.
    target = SimpleNamespace(url=servers["bf16"].url, model=None, log_path=None, check_alive=lambda: None)
    bf16 = _run(tmp_path, {**FEW, "baseline_url": servers["a"].url}, target=target)
    assert bf16.ok, bf16.error
    kl = bf16.meta["quality"]["pooled"]["kl_div"]
    assert 0.0 < kl < 1e-3
    assert all(v > 0 for v in _values(bf16, "logprob_err_p50"))
    assert min(_values(bf16, "top1_agreement")) > 0.9
    seed = _run(tmp_path, {**FEW, "baseline_url": servers["a"].url, "candidate_url": servers["seed"].url,
                           "max_kl_div": 1e-3, "min_top1_agreement": 0.9})
    pooled = seed.meta["quality"]["pooled"]
    # Other weights: another model.  Random weights give near-flat distributions (perplexity
    # near the vocabulary's 512), so the top-5 buckets hold little mass and the KL's lower
    # bound is loose; top-1 agreement shows it plainly.
    assert pooled["kl_div"] > 100 * kl and pooled["top1_agreement"] < 0.5
    assert not seed.ok and "kl_div" in (seed.error or "") and "top1_agreement" in (seed.error or "")
    assert seed.measurements and seed.findings[0].severity == "error"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    """An OpenAI-ish server that refuses echo (400) on /v1/completions, and one that ignores it."""
    import uvicorn

    app = FastAPI()

    @app.post("/refuses/v1/completions")
    async def refuses(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("echo"):
            return JSONResponse({"error": {"message": "echo is not supported", "type": "invalid_request_error"}}, 400)
        return JSONResponse({"choices": [{"text": "x", "logprobs": None}]})

    @app.post("/ignores/v1/completions")
    async def ignores(request: Request) -> JSONResponse:
        return JSONResponse({"choices": [{"text": "x", "logprobs": None, "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 1}})

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the stub server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("kind", ["refuses", "ignores"])
def test_a_server_without_echo_logprobs_gives_a_finding_and_no_metrics(tmp_path: Path, servers: dict[str, Any],
                                                                       stub: str, kind: str) -> None:
    fb = _run(tmp_path, {**FEW, "baseline_url": servers["a"].url, "candidate_url": f"{stub}/{kind}"})
    assert not fb.ok and fb.measurements == []  # never zeros
    (finding,) = fb.findings
    assert finding.kind == FindingKind.NO_LOGPROBS and finding.evidence["side"] == "candidate"
    assert ("HTTP 400" in finding.message) if kind == "refuses" else ("no logprobs" in finding.message)
    # A criterion on it is an error naming why, not a pass.
    ws = load_workspace(EXAMPLE)
    gates = {g.name: g for g in criteria_gates(ws, {}, None, "e1", checks={"quality": fb})}
    assert gates["kl-to-reference"].outcome == "error" and "not measured" in gates["kl-to-reference"].message


# ---- the loop's way: launched from a workspace, judged by criteria ----

def _workspace(tmp_path: Path) -> Any:
    data = {
        "name": "quality-test",
        "target": {"kind": "server", "ready_url": "/health", "ready_timeout_s": 90,
                   "command": [sys.executable, "-m", "refstack.cli", "serve", "--preset", "tiny", "--host", "127.0.0.1",
                               "--port", "{port}", "--dtype", "float32", "--lm-head-precision", "{lm_head_precision}"]},
        "knobs": {"lm_head_precision": {"type": "choice", "choices": ["fp32", "bf16"], "default": "fp32",
                                        "components": ["model.lm_head"]}},
        "scenarios": {"s": {"dataset": {"kind": "random", "input_len": 8, "output_len": 4}, "num_requests": 2}},
        "checks": [{"name": "quality", "probe": "quality", "components": ["model"], "config": FEW}],
        "criteria": [{"name": "kl", "metric": "kl_div", "check": "quality", "value": 0.01},
                     {"name": "top1", "metric": "top1_agreement", "check": "quality", "value": 0.9},
                     {"name": "kl-tight", "metric": "kl_div", "check": "quality", "value": 1e-9}],
    }
    root = tmp_path / "ws"
    root.mkdir()
    (root / "infra-agent.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return load_workspace(root)


def test_launched_from_the_workspace_with_a_changed_knob_and_judged_by_criteria(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    assert [c.op for c in ws.criteria] == ["<=", ">=", "<="]  # directions known without `op` or `custom`
    fb = _run(tmp_path, ws.check("quality").config, workspace=ws, knobs={"lm_head_precision": "bf16"})
    assert fb.ok, fb.error
    q = fb.meta["quality"]
    assert q["baseline"]["knobs"]["lm_head_precision"] == "fp32" and q["changed_knobs"] == {"lm_head_precision": "bf16"}
    assert fb.findings[0].location is not None and fb.findings[0].location.knob == "lm_head_precision"
    assert sum(a.kind == "log" for a in fb.artifacts) == 2  # both servers were launched, and stopped
    gates = {g.name: g for g in criteria_gates(ws, {}, None, "e1", checks={"quality": fb})}
    assert gates["kl"].outcome == "pass" and gates["top1"].outcome == "pass", gates
    assert gates["kl-tight"].outcome == "fail" and "prompt(s)" in gates["kl-tight"].interval
    assert criteria_gates(ws, {}, None, "e1") == []  # no check ran: nothing to judge


def test_the_quantization_example_loads_with_its_quality_criteria() -> None:
    ws = load_workspace(EXAMPLE)
    assert set(ws.knobs) == {"dtype", "quantization", "kv_cache_dtype", "kv_cache_dtype_layers"}
    by_name = {c.name: c for c in ws.criteria}
    assert by_name["decode-speed"].scenario == "decode" and by_name["decode-speed"].ratio == 1.10
    assert (by_name["kl-to-reference"].check, by_name["kl-to-reference"].op) == ("quality", "<=")
    assert (by_name["top1-agreement"].op, by_name["top1-agreement"].value) == (">=", 0.99)
    QualityProbe.parse_config(ws.check("quality").config)
