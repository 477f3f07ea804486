"""One worker job: a subprocess in its own process group, with a timeout and a kill path.

The job is written to ``<jobs_dir>/<experiment>/job-N.json``; the worker writes
``result-N.json`` atomically and its stderr to ``worker-N.log``.  Its stdout carries
one JSON event per line, forwarded to ``on_event``.  Whatever happens (a timeout,
Ctrl-C, a crash), the worker's group and every process marked with the experiment
are killed before this returns or raises.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from infra_agent.agent.executors.base import OnEvent
from infra_agent.agent.executors.cleanup import MARKER_ENV, PARENT_ENV, kill_marked
from infra_agent.errors import InfraAgentError


class ProbeTimeout(InfraAgentError):
    pass


def run_job(jobs_dir: Path, run_id: str, exp_id: str, job: dict[str, Any], timeout_s: float, on_event: OnEvent | None,
            what: str) -> dict[str, Any]:
    """Run ``job`` for experiment ``exp_id``; ``what`` names it in errors (``check 'unit' (command probe)``)."""
    d = jobs_dir / exp_id
    d.mkdir(parents=True, exist_ok=True)
    n = len(list(d.glob("job-*.json")))
    job_path, result_path, log_path = d / f"job-{n}.json", d / f"result-{n}.json", d / f"worker-{n}.log"
    job_path.write_text(json.dumps({**job, "workdir": str(d / f"out-{n}")}, default=str))
    marker = f"{run_id}/{exp_id}"
    env = {**os.environ, MARKER_ENV: marker, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "infra_agent.agent.executors.worker", str(job_path), str(result_path)],
                                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    reader = threading.Thread(target=_forward, args=(proc, on_event), daemon=True)
    reader.start()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _kill(proc)
        kill_marked(marker)
        raise ProbeTimeout(f"{what} of {exp_id} timed out after {timeout_s:g} s; killed its process group "
                           f"and the servers it started (worker log: {log_path})") from None
    except BaseException:
        _kill(proc)
        kill_marked(marker)
        raise
    finally:
        reader.join(timeout=2)
    kill_marked(marker)  # a server that outlived a crashed worker
    if not result_path.exists():
        tail = log_path.read_text(errors="replace")[-2000:]
        raise InfraAgentError(f"{what} of {exp_id}: the probe worker exited {proc.returncode} without a result "
                              f"(log: {log_path})\n{tail}")
    try:
        return dict(json.loads(result_path.read_text()))
    except ValueError as exc:
        raise InfraAgentError(f"{what} of {exp_id}: unreadable result {result_path}: {exc}") from None


def _forward(proc: subprocess.Popen[bytes], on_event: OnEvent | None) -> None:
    """Drain the worker's stdout to the end, whatever the callback does: a reader that
    stopped would let the pipe fill and block the worker until its timeout."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if on_event is None:
            continue
        try:
            on_event(json.loads(line))
        except Exception:  # noqa: BLE001, S112 - progress display only; the job goes on
            continue


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
