"""The judge: bootstrap intervals of candidate/baseline ratios, verdicts per gate, and the
interleaved A B A B driver.

See :mod:`infra_agent.stats.bootstrap`, :mod:`infra_agent.judge.verdict` and
:mod:`infra_agent.judge.interleave`.
"""
