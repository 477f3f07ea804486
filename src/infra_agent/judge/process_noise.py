"""The spread between server processes, as the loop's judge applies it.

Every batch of pairs runs on freshly started servers, and two processes of one
configuration differ by an offset the batch's pairs share (stats/process_noise.py).
Pooled over ``R`` batches, the per-pair ratios of an A/B carry ``R`` such offsets; the
interval adds their variance ``tau^2 / R`` (stats/intervals.py).  Without it, an A/A
on a shared machine excluded 1.0 in 5-7% of comparisons instead of 5%
(docs/lab-notebook/judge-ab-power.md).

Where ``tau`` comes from (``run --process-noise``):

- ``auto`` (default): the workspace's calibration (``infra-agent calibrate``,
  ``.infra-agent/process-noise.json``) when it was measured on this machine, for each
  metric whose blocks differ by more than their windows' noise explains (the F test,
  :func:`shows_spread`); otherwise none, and the loop says so;
- a number: that spread for every metric (``0.02`` = 2% in log ratio);
- ``off``: no process term (the interval of the pairs alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from infra_agent.errors import ConfigError
from infra_agent.serving.noise_record import Machine, NoiseCalibration, load

Setting = float | str  # "auto", "off" or a spread
SPREAD_P = 0.05  # a metric's calibrated spread is used where its F test rejects "no spread" at this level


@dataclass(frozen=True)
class ProcessNoise:
    """Per-metric ``tau`` and the restarts (fresh process pairs) the judged pairs came from."""

    taus: dict[str, float] = field(default_factory=dict)
    default: float = 0.0  # for a metric the calibration did not measure
    restarts: int = 1
    source: str = ""

    def after(self, restarts: int) -> ProcessNoise:
        """The same spread over ``restarts`` batches of fresh processes."""
        return replace(self, restarts=max(1, int(restarts)))

    def tau(self, metric: str) -> float:
        return self.taus.get(metric, self.default)

    def text(self) -> str:
        shown = ", ".join(f"{k} {v:.2%}" for k, v in list(self.taus.items())[:4])
        if not shown:
            shown = f"{self.default:.2%} for every metric"
        return f"process noise between fresh servers: {shown} ({self.source}); each batch is a new process pair"


def parse_setting(value: Setting | None) -> Setting:
    """``auto``, ``off`` or a spread >= 0 (a fraction); a ConfigError names ``--process-noise`` otherwise."""
    if value is None:
        return "auto"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and value.strip().lower() in ("auto", "off"):
        return value.strip().lower()
    else:
        try:
            number = float(str(value))
        except ValueError:
            number = math.nan
    if not math.isfinite(number) or number < 0 or number >= 1:
        raise ConfigError("--process-noise", None, "auto, off, or a spread in [0, 1) such as 0.02 (2%)", value)
    return number


def resolve(root: Path, setting: Setting | None, say: list[str] | None = None) -> ProcessNoise | None:
    """The process term for a run on the workspace at ``root``; None for none.

    ``say`` collects a line on why the calibration was not used (another machine)."""
    value = parse_setting(setting)
    if value == "off":
        return None
    if isinstance(value, float):
        return ProcessNoise(default=value, source="--process-noise") if value > 0 else None
    cal = load(root)  # a damaged file raises ConfigError naming it
    if cal is None:
        if say is not None:
            say.append("process noise: not calibrated for this workspace (`infra-agent calibrate`); the interval "
                       "counts only the pairs' own spread")
        return None
    here = _elsewhere(cal)
    if here is not None:
        if say is not None:
            say.append(f"process noise: the calibration in {root / '.infra-agent/process-noise.json'} was measured on "
                       f"{cal.machine.hostname} ({cal.machine.usable_cpus} CPUs), not here ({here.hostname}, "
                       f"{here.usable_cpus} CPUs): not used; run `infra-agent calibrate` on this machine")
        return None
    taus = shown_taus(cal)
    if not any(taus.values()):
        if say is not None:
            say.append(f"process noise: the calibration found no spread between fresh servers (F test p >= "
                       f"{SPREAD_P}); the interval is the pairs' own")
        return None
    # A metric the calibration did not measure gets the largest spread it did (errs wide).
    return ProcessNoise(taus=taus, default=max(taus.values()),
                        source=f"calibrated on scenario {cal.scenario}, {cal.blocks} x {cal.pairs_per_block} A/A")


def shows_spread(p: float | None) -> bool:
    """Whether a calibration's F test says the fresh process pairs differ (p < SPREAD_P).

    Where it does not, the method-of-moments spread is the noise of its own estimate
    (truncated at 0, so never negative and biased up): adding it would widen every interval
    for an offset the blocks could not show, at a cost in power (on A/A runs of this
    machine: power at a 5% effect 7-26% without, 4-18% with an estimate of F = 1.16,
    p = 0.24; docs/lab-notebook/judge-ab-power.md).  An undefined p (no within-block
    noise) keeps the spread."""
    return p is None or p < SPREAD_P


def _elsewhere(cal: NoiseCalibration) -> Machine | None:
    """This machine, when the calibration was measured on another (a host or a CPU count apart)."""
    here = Machine.here()
    return None if (cal.machine.hostname, cal.machine.usable_cpus) == (here.hostname, here.usable_cpus) else here


def shown_taus(cal: NoiseCalibration) -> dict[str, float]:
    """Each metric's spread where its F test shows one, else 0 (:func:`shows_spread`)."""
    return {name: m.tau if shows_spread(m.p) else 0.0 for name, m in cal.metrics.items()}


def reuse_servers(root: Path, setting: Setting | None) -> tuple[bool, str]:
    """Whether batches may share server processes (agent/executors/server_pool.py), and why.

    Reuse keeps one process pair for every batch of an experiment, so an offset between
    processes would never average out: it is sound only where there is none to average.
    That takes evidence: this machine's calibration showing no spread for any metric, or
    ``--process-noise off`` (the user's word that there is none)."""
    value = parse_setting(setting)
    if value == "off":
        return True, "--process-noise off"
    if isinstance(value, float):
        return (value == 0.0), f"--process-noise {value:g}"
    cal = load(root)
    if cal is None:
        return False, "no process-noise calibration (`infra-agent calibrate`)"
    if _elsewhere(cal) is not None:
        return False, "the process-noise calibration is from another machine"
    shown = sorted(name for name, tau in shown_taus(cal).items() if tau > 0)
    if shown:
        return False, f"the calibration shows a spread between fresh servers ({', '.join(shown[:3])})"
    return True, f"the calibration shows no spread between fresh servers ({cal.blocks} x {cal.pairs_per_block} A/A)"


def tau_for(noise: ProcessNoise | None, metric: str) -> tuple[float, int]:
    """(tau, restarts) for ``metric`` (no term: (0, 1))."""
    if noise is None:
        return 0.0, 1
    return noise.tau(metric), noise.restarts


__all__ = ["SPREAD_P", "ProcessNoise", "Setting", "parse_setting", "resolve", "reuse_servers", "shows_spread",
           "tau_for"]
