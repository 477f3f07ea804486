"""The timeline probe's sampled window: the load runs on a thread while py-spy samples the server.

Apart from the probe because it is a concurrency of its own: the window must run on a
worker thread so that the probe's thread can pick the process to sample once the load
is on (``lead_s``), sample it while the window runs, and stop sampling when it ends;
an error of the window is re-raised on the probe's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra_agent.probes.target_processes import pick_process
from infra_agent.probes.timeline_config import TimelineConfig

if TYPE_CHECKING:
    from infra_agent.trace.sampler import PySpyResult


def sampled_window(cfg: TimelineConfig, run_window: Callable[[], dict[str, Any]], pid: int | None,
                   samples_path: Path, port: int | None = None) -> tuple[dict[str, Any], PySpyResult, dict[str, Any], PySpyResult | None]:
    """``run_window()``'s result, the py-spy samples taken while it ran, the process sampled, and
    the ``py-spy record`` of that process for its event loops' stalls (None: not recorded).

    ``pid`` is the server's (None: a server given by URL, nothing to sample); the process
    sampled is picked among it and its children (``cfg.sample_process``).  With the server's
    ``port``, ``picked["tcp_nodelay"]`` says whether its client connections had Nagle off while
    the load ran (probes/socket_options.py; None: unknown).
    """
    from infra_agent.trace.sampler import PySpyDumpSampler, PySpyRecorder, PySpyResult

    box: dict[str, Any] = {}

    def load() -> None:
        try:
            box["result"] = run_window()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the probe's thread
            box["error"] = exc

    worker = threading.Thread(target=load, name="timeline-load", daemon=True)
    worker.start()
    sampler = recorder = None
    picked: dict[str, Any] = {}
    res = None
    if not cfg.sample:
        res = PySpyResult(None, None, None)
    elif pid is None:
        res = PySpyResult(None, None, "py-spy unavailable, spans only: the target's process id is unknown "
                                       "(a server given by URL)")
    else:
        sampled, picked = pick_process(int(pid), cfg.sample_process, cfg.lead_s, worker)
        if port is not None and worker.is_alive():  # the connections are open while the load runs
            from infra_agent.probes.socket_options import tcp_nodelay

            picked["tcp_nodelay"] = tcp_nodelay(int(pid), port)
        if worker.is_alive():
            sampler = PySpyDumpSampler(sampled, samples_path, interval_s=cfg.sample_interval_s).start()
            if cfg.loop_stalls:
                # Every thread at a fixed rate, idle ones included (a loop parked off the GIL
                # is the point), without pausing the target: trace/loop_stalls.py.
                recorder = PySpyRecorder(sampled, samples_path.with_name(samples_path.stem + "-record.json"),
                                         rate=cfg.stall_rate_hz, gil=False, idle=True, nonblocking=True).start()
    worker.join()
    stall_res = recorder.stop() if recorder is not None else None
    if sampler is not None:
        res = sampler.stop()
    elif res is None:
        res = PySpyResult(None, None, "py-spy unavailable, spans only: the window ended before sampling started "
                                       f"(lead_s {cfg.lead_s:g} s is longer than the window)")
    if "error" in box:
        raise box["error"]
    return box["result"], res, picked, stall_res
