"""The spread between fresh server processes: its estimate, the interval term, the plan, and
where the loop's judge takes it from."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from infra_agent.errors import ConfigError
from infra_agent.judge.process_noise import (
    ProcessNoise,
    parse_setting,
    resolve,
    shows_spread,
    tau_for,
)
from infra_agent.judge.sample_plan import Noise, plan_sample
from infra_agent.judge.sequential import detectable_effect, fixed_design_pairs
from infra_agent.serving.noise_record import (
    CALIBRATION_FILE,
    Machine,
    MetricNoise,
    NoiseCalibration,
    load,
    save,
)
from infra_agent.stats.intervals import label, log_ratio_interval
from infra_agent.stats.process_noise import between_process_spread


def _blocks(rng: np.random.Generator, k: int, n: int, tau: float, sigma: float) -> list[list[float]]:
    return [list(rng.normal(0.0, tau) + rng.normal(0.0, sigma, n)) for _ in range(k)]


def test_the_estimate_recovers_a_known_spread_and_finds_none_where_there_is_none() -> None:
    rng = np.random.default_rng(7)
    s = between_process_spread(_blocks(rng, 300, 3, 0.03, 0.08))
    assert 0.02 < s.tau < 0.04 and abs(s.within_sd - 0.08) < 0.008 and s.p < 0.01
    assert s.df == (299, 600) and s.blocks == 300 and s.pairs == 900
    none = between_process_spread(_blocks(rng, 300, 3, 0.0, 0.08))
    assert none.tau < 0.012 and none.p > 0.01


def test_unequal_blocks_and_too_little_data() -> None:
    s = between_process_spread([[0.01, 0.02, 0.0], [0.1, 0.12], [math.nan, 0.05, 0.04, 0.06]])
    assert s.blocks == 3 and s.pairs == 8 and s.tau > 0
    with pytest.raises(ValueError, match="at least 2 blocks"):
        between_process_spread([[0.1, 0.2, 0.3]])
    with pytest.raises(ValueError, match="at least 2 windows"):
        between_process_spread([[0.1], [0.2]])


@pytest.mark.parametrize("batches", [1, 2, 4])
def test_an_aa_with_a_process_offset_per_batch_holds_its_rate_only_with_the_term(batches: int) -> None:
    # Batches of 3 pairs, each on a fresh process pair with a 3% offset, 5% noise per window.
    rng = np.random.default_rng(100 + batches)
    tau, sigma, trials = 0.03, 0.05, 2000
    without = with_term = 0
    for _ in range(trials):
        logs = np.concatenate([rng.normal(0.0, tau) + rng.normal(0.0, sigma, 3) for _ in range(batches)])
        plain = log_ratio_interval(np.exp(logs))
        wide = log_ratio_interval(np.exp(logs), process_noise=tau, restarts=batches)
        without += not plain.low <= 1.0 <= plain.high
        with_term += not wide.low <= 1.0 <= wide.high
    assert without / trials > 0.08  # the pairs alone cannot see the offset they share
    assert with_term / trials <= 0.055


def test_the_term_only_widens_and_averages_out_over_restarts() -> None:
    ratios = [1.02, 0.97, 1.05, 1.01, 0.99, 1.04]
    plain = log_ratio_interval(ratios)
    widths = [log_ratio_interval(ratios, process_noise=0.03, restarts=r) for r in (1, 2, 6)]
    for ci in widths:
        assert ci.low <= plain.low and ci.high >= plain.high and ci.ratio == pytest.approx(plain.ratio)
    assert widths[0].high - widths[0].low > widths[1].high - widths[1].low > widths[2].high - widths[2].low
    assert "process noise 3.00% over 2 restart(s)" in label(widths[1], "ratio")


def test_the_plan_needs_more_pairs_in_more_batches_and_says_why() -> None:
    plain = fixed_design_pairs(0.05, 0.05)
    with_term = fixed_design_pairs(0.05, 0.05, process_noise=0.03, batch=3)
    assert with_term > plain
    # More pairs in one batch cannot average the offset out: the detectable effect has a floor.
    assert detectable_effect(0.05, 300, process_noise=0.03) > 0.05 > detectable_effect(0.05, 300, process_noise=0.03,
                                                                                       batch=3)
    sp = plan_sample("output_throughput", 0.05, Noise(sd=0.05, df=10, source="test"), batch=3, max_pairs=12,
                     process_noise=0.03)
    assert not sp.feasible and "3.0% between server processes" in sp.text() and "many more batches" in sp.text()
    assert sp.as_dict()["process_noise"] == 0.03


def _calibration(hostname: str | None = None, p_ttft: float = 0.001) -> NoiseCalibration:
    here = Machine.here()

    def metric(tau: float, p: float) -> MetricNoise:
        return MetricNoise(tau=tau, within_sd=0.06, f=3.0, df=(5, 12), p=p, blocks=6, pairs=18)

    return NoiseCalibration(scenario="chat", machine=Machine(hostname=hostname or here.hostname,
                                                             usable_cpus=here.usable_cpus),
                            blocks=6, pairs_per_block=3,
                            metrics={"output_throughput": metric(0.02, 0.01), "median_ttft_ms": metric(0.05, p_ttft),
                                     # an estimate its F test does not back: the blocks may not differ at all
                                     "p99_ttft_ms": metric(0.08, 0.4)})


def test_resolve_reads_this_machines_calibration(tmp_path: Path) -> None:
    said: list[str] = []
    assert resolve(tmp_path, "auto", said) is None  # nothing calibrated: no term, and the run says so
    assert "not calibrated for this workspace" in said[0]
    save(tmp_path, _calibration())
    assert load(tmp_path) == _calibration().model_copy(update={"measured_at": load(tmp_path).measured_at})
    noise = resolve(tmp_path, "auto")
    assert noise is not None and noise.tau("output_throughput") == 0.02
    assert noise.tau("p99_ttft_ms") == 0.0  # F test p = 0.4: no spread shown, none added
    assert noise.tau("mean_itl_ms") == 0.05  # not calibrated: the largest spread shown
    assert tau_for(noise.after(3), "median_ttft_ms") == (0.05, 3) and tau_for(None, "x") == (0.0, 1)
    assert resolve(tmp_path, "off") is None
    fixed = resolve(tmp_path, 0.04)
    assert isinstance(fixed, ProcessNoise) and fixed.tau("anything") == 0.04
    save(tmp_path, _calibration("another-host"))
    notes: list[str] = []
    assert resolve(tmp_path, "auto", notes) is None and "another-host" in notes[0]


def test_a_calibration_that_shows_no_spread_adds_none(tmp_path: Path) -> None:
    cal = _calibration(p_ttft=0.3)
    cal.metrics["output_throughput"] = cal.metrics["output_throughput"].model_copy(update={"p": 0.85})
    save(tmp_path, cal)
    notes: list[str] = []
    assert resolve(tmp_path, "auto", notes) is None and "found no spread" in notes[0]
    assert shows_spread(None) and shows_spread(0.049) and not shows_spread(0.05)


def test_a_damaged_calibration_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / CALIBRATION_FILE
    path.parent.mkdir(parents=True)
    path.write_text('{"scenario": "chat", "metrics": ')
    with pytest.raises(ConfigError, match="process-noise.json: expected a process-noise calibration"):
        resolve(tmp_path, "auto")


@pytest.mark.parametrize("value", ["-0.1", "lots", "1.5", "nan", True])
def test_a_bad_setting_names_the_option(value: object) -> None:
    with pytest.raises(ConfigError, match="--process-noise"):
        parse_setting(value)  # type: ignore[arg-type]


def test_settings() -> None:
    assert parse_setting(None) == "auto" and parse_setting("OFF") == "off" and parse_setting("0.02") == 0.02
    assert parse_setting(0) == 0.0
