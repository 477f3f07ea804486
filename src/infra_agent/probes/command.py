"""``CommandProbe``: a unit check as a probe (tier ``check``).

Runs one declared command (a test suite, a linter, a build) in the code under test and
passes when it exits 0.  The command comes from the workspace, never from a model: a
proposer can cause it to run, not choose what runs.  Its output enters Feedback cut to
head + tail, as data.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from typing import Any, ClassVar

from pydantic import Field

from infra_agent.feedback import (
    Artifact,
    Feedback,
    Finding,
    Location,
    Measurement,
    Tier,
)
from infra_agent.probes.base import Probe, ProbeConfig, ProbeContext
from infra_agent.safety import bound, scrub_text
from infra_agent.vocabulary import FindingKind


class CommandConfig(ProbeConfig):
    command: str | list[str] = Field(description="argv list, or a string split like a shell would (no shell)")
    cwd: str | None = Field(None, description="relative to the code root")
    timeout_s: float = Field(600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)


class CommandProbe(Probe):
    name: ClassVar[str] = "command"
    base_tier: ClassVar[Tier] = Tier.check
    Config: ClassVar[type[ProbeConfig]] = CommandConfig
    components: ClassVar[tuple[str, ...]] = ("server", "engine", "model", "kernel", "runtime", "kv_transfer", "comm")

    @classmethod
    def measures(cls, metric: str) -> bool:
        return metric in ("failed_checks", "checked")

    def run(self, config: Any, ctx: ProbeContext) -> Feedback:
        cfg: CommandConfig = self.parse_config(config)  # type: ignore[assignment]
        argv = shlex.split(cfg.command) if isinstance(cfg.command, str) else list(cfg.command)
        root = ctx.workspace.root if ctx.workspace is not None else ctx.workdir
        cwd = root / cfg.cwd if cfg.cwd else root
        ctx.workdir.mkdir(parents=True, exist_ok=True)
        log = ctx.workdir / f"command-{int(time.time() * 1000)}.log"
        fb = Feedback(probe=self.name, tier=self.tier(cfg), scope=self.scope)
        start = time.perf_counter()
        try:
            with log.open("wb") as out:
                proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **cfg.env}, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    rc: int | None = proc.wait(cfg.timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    rc = None
        except OSError as exc:
            fb.ok, fb.error = False, f"cannot run {argv[0]!r} in {cwd}: {exc.strerror}"
            return fb
        wall = time.perf_counter() - start
        fb.measurements.append(Measurement.from_samples("command_wall_s", "s", [wall], better="lower"))
        fb.artifacts.append(Artifact(kind="log", path=str(log), description=" ".join(argv)))
        fb.meta.update(checked=1, failed_checks=int(rc != 0), exit_code=rc)
        if rc == 0:
            return fb
        output = scrub_text(bound(log.read_bytes().decode("utf-8", errors="replace"), 4000))
        fb.ok = False
        fb.error = f"`{' '.join(argv)}` timed out after {cfg.timeout_s:g}s" if rc is None else f"`{' '.join(argv)}` exited {rc}"
        fb.findings.append(Finding(kind=FindingKind.COMMAND_FAILED, severity="error", message=fb.error,
                                   location=Location(file=str(log)), evidence={"exit_code": rc, "output": output},
                                   next_question="Which assertion failed, and does the change explain it?"))
        return fb
