"""Serving benchmark: datasets, arrivals, a streaming OpenAI client, vLLM-compatible metrics,
Prometheus phase deltas, the runner and ``ServingProbe``.

Entry points: :func:`infra_agent.serving.runner.run_benchmark` (a URL),
:func:`infra_agent.serving.runner.run_workspace_scenario` (a workspace target),
:class:`infra_agent.probes.serving.ServingProbe`.  Nothing is imported here, so importing
the package stays cheap.
"""
