"""Servers kept up across experiments: one launch per configuration, real refstack servers.

The pool (agent/executors/server_pool.py) starts a configuration's server once and keeps
it for the batches and experiments that need it; reuse is on only where the spread
between fresh processes is known to be nil (judge/process_noise.py ``reuse_servers``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from infra_agent.agent.executors.server_pool import ServerPool
from infra_agent.judge.process_noise import reuse_servers
from infra_agent.serving.noise_record import (
    Machine,
    MetricNoise,
    NoiseCalibration,
    save,
)
from infra_agent.target.attached import alive
from infra_agent.workspace import load_workspace

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

pytestmark = pytest.mark.timeout(900)


def _workspace(dest: Path) -> Path:
    from time_to_fix import (
        make_workspace,  # the mis-set baseline the loop fixes in one experiment
    )

    return make_workspace(dest)


def _servers_in(ws: Path) -> list[int]:
    """Live processes whose working folder is the workspace (the servers it launched)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/cwd").resolve() == ws.resolve() and alive(int(entry)):
                    out.append(int(entry))
            except OSError:
                continue
    return out


def test_the_pool_keeps_restarts_and_stops_servers(tmp_path: Path) -> None:
    ws = load_workspace(_workspace(tmp_path / "ws"))
    pool = ServerPool()
    base, two = ws.resolve_knobs(), ws.resolve_knobs({"max_running": 8})
    try:
        k1, s1 = pool.acquire(ws, base, set(), tmp_path / "logs")
        k1_again, s1_again = pool.acquire(ws, base, {k1}, tmp_path / "logs")
        assert (k1_again, s1_again.pid) == (k1, s1.pid) and pool.launches == 1
        k2, s2 = pool.acquire(ws, two, {k1}, tmp_path / "logs")
        assert pool.launches == 2 and s2.pid != s1.pid and alive(s1.pid)
        os.killpg(s1.pid, signal.SIGKILL)  # a kept server dies between batches
        deadline = time.monotonic() + 10
        while alive(s1.pid) and time.monotonic() < deadline:
            s1._proc.poll()  # reap it, as the owner does
            time.sleep(0.05)
        assert pool.dead(k1)
        _, s1_new = pool.acquire(ws, base, {k1, k2}, tmp_path / "logs")
        assert pool.launches == 3 and pool.restarts == 1 and s1_new.pid != s1.pid
        pool.retain({k1})  # a batch of other servers: the rest stop first
        assert not alive(s2.pid) and alive(s1_new.pid)
    finally:
        assert pool.close() <= 1
    assert not _servers_in(ws.root)


def test_reuse_only_where_the_spread_is_known_to_be_nil(tmp_path: Path) -> None:
    assert reuse_servers(tmp_path, "auto") == (False, "no process-noise calibration (`infra-agent calibrate`)")
    assert reuse_servers(tmp_path, "off")[0] and not reuse_servers(tmp_path, 0.02)[0]

    def cal(p: float) -> NoiseCalibration:
        m = MetricNoise(tau=0.01, within_sd=0.05, f=2.0 if p < 0.05 else 0.9, df=(5, 12), p=p, blocks=6, pairs=18)
        return NoiseCalibration(scenario="chat", machine=Machine.here(), blocks=6, pairs_per_block=3,
                                metrics={"output_throughput": m})

    save(tmp_path, cal(0.6))
    assert reuse_servers(tmp_path, "auto")[0]
    save(tmp_path, cal(0.01))
    ok, why = reuse_servers(tmp_path, "auto")
    assert not ok and "output_throughput" in why


@pytest.mark.slow
def test_a_run_launches_each_configuration_once(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from infra_agent.agent.runner import RunOptions, start_run
    from infra_agent.ledger import Ledger

    ws = _workspace(tmp_path / "ws")
    opts = RunOptions(proposer="rules", budget_runs=2, pairs=3, process_noise="off", probe_timeout_s=300)
    run = start_run(ws, opts, progress=True)
    progress = capfd.readouterr().err
    with Ledger.for_workspace(ws) as ledger:
        exps = ledger.experiments(run.id)
    base, tried = exps[0], [e for e in exps if e.role == "experiment"]
    assert base.cost.launches == 1 and tried, [(e.id, e.status, e.error) for e in exps]
    e1 = tried[0]
    # The parent's server is the baseline's, kept; the candidate's serves every batch of e1.
    assert e1.status == "done" and e1.cost.launches == 1, (e1.status, e1.error, e1.cost)
    assert e1.cost.e2e_runs >= 6
    confirm = [e for e in exps if e.role == "confirm"]
    if confirm:
        # The pool keeps only the last batch's two servers. After e1 alone, best and baseline are both
        # still up; when a later experiment ran (its own parent and candidate), the best is one of them
        # and only the baseline's server may have to start again.
        assert confirm[0].cost.launches <= (0 if len(tried) == 1 else 1), (len(tried), confirm[0].cost)
    launches = sum(e.cost.launches for e in exps)
    assert launches <= len(exps), [(e.id, e.cost.launches) for e in exps]
    # The progress says which: a line per launch, and "kept up" for a server an earlier job started.
    assert progress.count("starting server") == launches, progress[-4000:]
    assert "server A: kept up, attached" in progress, progress[-4000:]
    assert not _servers_in(ws), "a kept server outlived the run"


def test_the_cli_says_when_servers_are_kept(tmp_path: Path) -> None:
    ws = _workspace(tmp_path / "ws")
    spec = yaml.safe_load((ws / "infra-agent.yaml").read_text())
    assert spec["criteria"]
    bad = subprocess.run([sys.executable, "-m", "infra_agent.cli.main", "run", str(ws), "--reuse-servers", "always",
                          "--no-report"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--reuse-servers" in bad.stderr
