"""Findings from the engine's own telemetry and the server's CPU.

The parser reads real exposition text: vLLM 0.32's CPU build's ``/metrics`` (recorded,
``tests/infra_agent/serving/fixtures/vllm-0.32-cpu-metrics-*.txt``), and text written by
``prometheus_client`` (the library both engines export with) under the engines' metric
names, for the states a recording of an idle tiny model does not hold (preemptions, a
full KV cache): written, not recorded.  The mapping runs on a live refstack over HTTP,
and the CPU starvation finding on a live refstack pinned to one CPU with two CPU hogs
beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from infra_agent.feedback import Feedback, Finding, Tier
from infra_agent.probes.base import ProbeContext
from infra_agent.probes.serving import ServingProbe
from infra_agent.probes.serving_telemetry import add_telemetry
from infra_agent.serving.telemetry import parse_values, summarise
from infra_agent.vocabulary import FindingKind

FIXTURES = Path(__file__).resolve().parents[1] / "serving" / "fixtures"
_LINUX = pytest.mark.skipif(not Path("/proc/self/schedstat").is_file(), reason="needs Linux /proc schedstat")


def _vllm_text(running: float, waiting: float, kv: float, preempted: float, hits: float, queries: float) -> str:
    """vLLM's names, labels and types, as its prometheus_client registry writes them (two engines)."""
    reg = CollectorRegistry()
    labels = ("model_name", "engine")
    g_run = Gauge("vllm:num_requests_running", "running", labels, registry=reg)
    g_wait = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=reg)
    g_kv = Gauge("vllm:kv_cache_usage_perc", "kv", labels, registry=reg)
    c_pre = Counter("vllm:num_preemptions", "preemptions", labels, registry=reg)
    c_hit = Counter("vllm:prefix_cache_hits", "hits", labels, registry=reg)
    c_q = Counter("vllm:prefix_cache_queries", "queries", labels, registry=reg)
    for engine, share in (("0", 0.5), ("1", 0.5)):
        lbl = {"model_name": "m", "engine": engine}
        g_run.labels(**lbl).set(running * share)
        g_wait.labels(**lbl).set(waiting * share)
        g_kv.labels(**lbl).set(kv if engine == "0" else kv / 2)
        c_pre.labels(**lbl).inc(preempted * share)
        c_hit.labels(**lbl).inc(hits * share)
        c_q.labels(**lbl).inc(queries * share)
    return generate_latest(reg).decode()


def test_the_parser_reads_vllms_recorded_metrics_as_prometheus_does() -> None:
    text = (FIXTURES / "vllm-0.32-cpu-metrics-after.txt").read_text()
    mine = parse_values(text)
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"} <= set(mine)
    # The line scan agrees with the reference parser on every sample it keeps.
    ref: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in mine:
                ref[s.name] = ref.get(s.name, 0.0) + float(s.value)
    assert mine == pytest.approx(ref)
    before = parse_values((FIXTURES / "vllm-0.32-cpu-metrics-before.txt").read_text())
    out = summarise([before, mine], 0.5)
    assert out["stack"] == "vllm" and out["counters"]["prefix_cache_queries"]["delta"] == mine["vllm:prefix_cache_queries_total"]
    sglang = parse_values((FIXTURES / "sglang-metrics-after.txt").read_text())
    assert summarise([sglang], 0.5)["gauges"]["kv_cache_usage"]["metric"] == "sglang:token_usage"


def _fb_with_queue(name: str) -> Feedback:
    fb = Feedback(probe="serving", tier=Tier.e2e)
    fb.findings.append(Finding(kind=FindingKind.BURSTY_STREAM, message="bursts"))
    fb.findings.append(Finding(kind=FindingKind.QUEUE_DOMINATES_TTFT, message="queue", evidence={"scenario": name}))
    return fb


def test_preemptions_and_a_full_kv_cache_become_findings() -> None:
    polls = [parse_values(_vllm_text(r, w, kv, p, h, q)) for r, w, kv, p, h, q in
             ((4, 0, 0.40, 0, 0, 100), (8, 6, 0.97, 2, 30, 300), (8, 4, 0.99, 5, 60, 500))]
    tel = summarise(polls, 0.5)
    # Summed over engines, the fullest engine's KV; counters as the last poll less the first.
    assert tel["gauges"]["running"]["max"] == 8 and tel["gauges"]["kv_cache_usage"]["max"] == pytest.approx(0.99)
    assert tel["counters"]["preemptions"]["delta"] == 5 and tel["prefix_cache_hit_rate"] == pytest.approx(60 / 400)
    fb = _fb_with_queue("s")
    add_telemetry(fb, "s", [{"ok": True, "engine_telemetry": tel}])
    kinds = [f.kind for f in fb.findings]
    # The engine's findings go before the network's.
    assert kinds == [FindingKind.PREEMPTIONS, FindingKind.KV_CACHE_FULL, FindingKind.BURSTY_STREAM,
                     FindingKind.QUEUE_DOMINATES_TTFT]
    queue = next(f for f in fb.findings if f.kind == FindingKind.QUEUE_DOMINATES_TTFT)
    assert queue.evidence["limit"] == "kv_cache" and queue.evidence["running_max"] == 8
    assert fb.measurement("server_preemptions", scenario="s").samples == [5.0]
    # Free KV and nothing preempted: no such finding; the queue is the running cap's.
    calm = summarise([parse_values(_vllm_text(2, 3, 0.2, 0, 0, 0)), parse_values(_vllm_text(2, 5, 0.3, 0, 0, 0))], 0.5)
    fb = _fb_with_queue("s")
    add_telemetry(fb, "s", [{"ok": True, "engine_telemetry": calm}])
    assert [f.kind for f in fb.findings] == [FindingKind.BURSTY_STREAM, FindingKind.QUEUE_DOMINATES_TTFT]
    assert fb.findings[1].evidence["limit"] == "running_slots" and "at most 2 ran at once" in fb.findings[1].message


_SCENARIO = {"dataset": {"kind": "random", "input_len": 16, "output_len": 8, "seed": 5}, "temperature": 1.0,
             "num_requests": 16, "max_concurrency": 8}


def test_refstacks_gauges_show_the_queue_behind_one_running_slot(refstack_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = refstack_server_factory(["--max-running", "1", "--step-delay-ms", "20"])
    fb = ServingProbe().run({"url": server.url, "metrics_url": server.url + "/metrics", "scenario": _SCENARIO},
                            ProbeContext(workdir=tmp_path, progress=False))
    assert fb.ok, fb.error
    running = fb.measurement("server_requests_running", scenario="inline")
    waiting = fb.measurement("server_requests_waiting", scenario="inline")
    assert max(running.samples) <= 1 and max(waiting.samples) > 0  # 8 in flight, one at a time
    queue = next(f for f in fb.findings if f.kind == FindingKind.QUEUE_DOMINATES_TTFT)
    assert queue.evidence["running_max"] == 1 and queue.evidence["limit"] == "running_slots"
    assert queue.evidence["kv_cache_usage_max"] is None  # refstack exports no KV fraction


def _pin_all_threads(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


@_LINUX
def test_a_server_sharing_its_cpu_with_hogs_is_reported_starved_before_the_network(refstack_server_factory,  # type: ignore[no-untyped-def]
                                                                                    tmp_path: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    server = refstack_server_factory(["--torch-threads", "1"])
    _pin_all_threads(server.proc.pid, {cpu})
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for h in hogs:
            os.sched_setaffinity(h.pid, {cpu})
        time.sleep(0.5)
        fb = ServingProbe().run({"url": server.url, "metrics_url": server.url + "/metrics", "scenario": _SCENARIO},
                                ProbeContext(workdir=tmp_path, progress=False))
    finally:
        for h in hogs:
            h.kill()
            h.wait(10)
    assert fb.ok, fb.error
    starved = [i for i, f in enumerate(fb.findings) if f.kind == FindingKind.SERVER_CPU_STARVED]
    assert starved, [f.message for f in fb.findings]
    f: Any = fb.findings[starved[0]]
    ev = f.evidence
    assert ev["api_server"] is True and ev["pid"] == server.proc.pid and ev["cpus_allowed"] == 1
    # Two hogs of the same weight on its one CPU: its threads waited for most of their runnable time.
    assert ev["wait_share"] >= 0.3 and ev["cores_used"] < ev["cores_demanded"]
    network = [i for i, g in enumerate(fb.findings) if g.kind in (FindingKind.BURSTY_STREAM, FindingKind.CLIENT_SERVER_TTFT_GAP)]
    assert all(starved[0] < i for i in network)
    # A network finding that remains asks the CPU question first.
    assert all((fb.findings[i].next_question or "").startswith("First: the server waited for a CPU") for i in network)
    assert fb.measurement("server_cpu_wait_share", scenario="inline").samples[0] >= 0.3


def test_credentials_go_to_the_servers_own_metrics_origin_only() -> None:
    from infra_agent.serving.telemetry import sample_during

    key = {"Authorization": "Bearer secret-key-123"}
    foreign = sample_during("http://127.0.0.1:9/metrics", key, "http://127.0.0.1:8/")
    own = sample_during("http://127.0.0.1:9/metrics", key, "http://127.0.0.1:9")
    assert foreign is not None and own is not None
    assert foreign.headers == {} and own.headers == key
    for s in (foreign, own):
        out = s.stop()  # nothing listens there: every poll failed, none raised
        assert out["polls"] == 0 and out["failed_polls"] >= 1 and out["stack"] is None
    assert sample_during(None, key) is None
