"""infra-agent: a dense feedback environment and agent loop for LLM inference performance.

Import submodules explicitly (``infra_agent.tracing``, ``infra_agent.feedback`` ...);
this package does no work at import time.
"""

__version__ = "0.1.0"
