"""Layer Split over HTTP: layer-granular KV transfer gives the tokens and logprobs of the
request-granular one, its per-layer sends overlap the next layers' compute in the trace,
the knob is validated, and a request whose send fails fails alone."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest

from infra_agent.trace.load import load_timeline
from infra_agent.trace.overlap import layer_overlap

# One prompt past a KV page, one over prefill_chunk (its layers leave in its second step),
# a one-token prompt (the native decode step: no layer hook fires), a multi-byte one.
PROMPTS: list[Any] = ["Hello", "The quick brown fox jumps over the lazy dog. " * 7, [65], "é€😀 mixed bytes"]
# A link slow enough that a layer's send is still on the wire while the next layers compute.
FLAGS = ("--max-seq-len", "384", "--dtype", "float32", "--disagg", "true", "--kv-page-tokens", "8",
         "--kv-link-gbps", "0.005", "--prefill-chunk", "256", "--trace", "true", "--trace-level", "layer")


def _answers(url: str) -> list[Any]:
    out = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 3}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append((choice["text"], choice["logprobs"], choice["finish_reason"]))
    body = {"prompt": "seeded", "max_tokens": 8, "temperature": 0.9, "seed": 1234}
    out.append(httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"])
    # A request that ends at its first token: its layers left already, and are dropped.
    body = {"prompt": "one token only", "max_tokens": 1, "temperature": 0, "logprobs": 1}
    out.append(httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"])
    return out


@pytest.fixture(scope="module")
def request_granular(refstack_module_server_factory: Any) -> list[Any]:
    server = refstack_module_server_factory([*FLAGS, "--kv-transfer", "false", "--kv-transfer-granularity", "request"])
    return _answers(server.url)


@pytest.mark.parametrize("kv_transfer", ["false", "true"])
def test_layer_granular_transfer_is_bit_identical_to_request_granular(
        request_granular: list[Any], refstack_module_server_factory: Any, kv_transfer: str) -> None:
    server = refstack_module_server_factory([*FLAGS, "--kv-transfer", kv_transfer,
                                             "--kv-transfer-granularity", "layer"])
    assert _answers(server.url) == request_granular
    info = httpx.get(server.url + "/debug/engine", timeout=10).json()["disagg"]
    assert (info["kv_transfer_granularity"], info["kv_link_gbps"]) == ("layer", 0.005)
    # Concurrent prompts: several requests' layers on the link at once, every one complete.
    with httpx.Client(timeout=120) as client, cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(client.post, server.url + "/v1/completions",
                            json={"prompt": f"request {i} " * (10 * i + 5), "max_tokens": 4, "ignore_eos": True})
                for i in range(4)]
        assert all(f.result().status_code == 200 for f in futs)
    trace = httpx.get(server.url + "/debug/trace", timeout=30).json()
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    sends = [e for e in trace["traceEvents"] if e.get("name") == "kv.send"]
    assert sends and {threads[(e["pid"], e["tid"])] for e in sends} == {"kv-link"}
    assert {e["args"]["layer"] for e in sends} == {0, 1, 2, 3}  # tiny's four layers, one message each
    # Layer i's send lies beside the compute of a later layer on the engine thread: the
    # overlap the pipeline exists for (the last layer has no later layer to hide behind).
    spans = load_timeline([_write(trace)]).span_sources()
    per_layer = {lo.layer: lo for lo in layer_overlap(spans)}
    assert set(per_layer) == {0, 1, 2, 3}
    assert max(per_layer[i].share for i in (0, 1, 2)) > 0.2, {i: lo.to_dict() for i, lo in per_layer.items()}
    assert per_layer[3].overlap_us == 0


def _write(trace: dict[str, Any]) -> Any:
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="layer-split-trace-")) / "trace.json"
    path.write_text(json.dumps(trace))
    return path


def test_the_granularity_knob_is_validated() -> None:
    r = subprocess.run([sys.executable, "-m", "refstack.cli", "serve", "--disagg", "true",
                        "--kv-transfer-granularity", "chunk"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--kv-transfer-granularity" in r.stderr and "request" in r.stderr and "layer" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "refstack.cli", "serve", "--kv-link-gbps", "-1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--kv-link-gbps" in r.stderr, r.stderr
    knobs = {k["name"]: k for k in json.loads(subprocess.run(
        [sys.executable, "-m", "refstack.cli", "knobs", "--json"], capture_output=True, text=True, timeout=60,
        check=True).stdout)}
    g = knobs["kv_transfer_granularity"]
    assert g["domain"] == {"choices": ["request", "layer"]} and g["default"] == "request"
    assert g["components"] == ["engine.kv_transfer"]
    link = knobs["kv_link_gbps"]
    assert link["domain"]["min"] == 0.0 and link["domain"]["typical"] and link["help"].lower().startswith("calibration")


@pytest.mark.parametrize("kv_transfer", ["false", "true"])
def test_a_failed_layer_send_fails_its_request_only(kv_transfer: str) -> None:
    """A request id the store's framing cannot carry (over 65,535 bytes) fails its first layer's
    send: that request ends with an error, as the request-granular transfer thread ends one,
    its slot comes back, and the next request gets the tokens it gets alone."""
    from refstack.disagg.frontend import DisaggEngine
    from refstack.engine import SamplingParams
    from refstack.knobs import engine_config, parse_knobs

    engine = DisaggEngine(engine_config(parse_knobs({
        "preset": "tiny", "dtype": "float32", "disagg": "true", "max_running": "1", "torch_threads": "1",
        "kv_transfer": kv_transfer, "kv_transfer_granularity": "layer", "kv_link_gbps": "0.01"})))
    engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        prompt = [256] + list(range(60))
        alone = engine.generate([prompt], params)[0]
        done = threading.Event()
        outs: list[Any] = []

        def sink(out: Any) -> None:
            if out.finished:
                outs.append(out)
                done.set()

        engine.add_request(prompt, params, sink, request_id="r" * 70_000)
        assert done.wait(120)
        assert outs[0].finish_reason == "error"
        after = engine.generate([prompt], params)[0]  # the one slot came back
        assert (after.token_ids, after.finish_reason) == (alone.token_ids, "length")
    finally:
        engine.stop()
