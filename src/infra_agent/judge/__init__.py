"""The judge: every decision on runs it is given.

:mod:`infra_agent.judge.gates` (each criterion, check and hypothesis as a GateResult),
:mod:`infra_agent.judge.accept` (the accept rule and the gate table),
:mod:`infra_agent.judge.pooling` (several runs as one Feedback),
:mod:`infra_agent.judge.sequential` and :mod:`infra_agent.judge.sample_plan` (how many
pairs, when to look), :mod:`infra_agent.judge.verdict` (result files compared, for
``infra-agent compare``).  The statistics are :mod:`infra_agent.stats`; the A/B runs are
made by :mod:`infra_agent.serving.interleave` and the executors: the judge launches nothing.
"""
