"""``infra-agent demo``: build a workspace from refstack and run the agent loop on it."""

from infra_agent.demo.build import build_demo_workspace
from infra_agent.demo.run import DemoResult, run_demo

__all__ = ["DemoResult", "build_demo_workspace", "run_demo"]
