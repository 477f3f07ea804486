"""The statistics every decision uses, below every layer that decides or summarises.

:mod:`~infra_agent.stats.bootstrap` (bootstrap intervals, ``RatioCI``),
:mod:`~infra_agent.stats.intervals` (t-intervals on log ratios, the one family the judge
decides on), :mod:`~infra_agent.stats.decision` (pass / fail / inconclusive from an
interval) and :mod:`~infra_agent.stats.statistic` (a check's own statistic).  Import the
modules; this package does nothing at import (scipy loads with them).
"""
