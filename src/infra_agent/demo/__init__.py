"""``infra-agent demo``: build a workspace from refstack and run today's loop on it."""

from infra_agent.demo.build import build_demo_workspace
from infra_agent.demo.run import DemoReport, DemoStep, run_demo

__all__ = ["DemoReport", "DemoStep", "build_demo_workspace", "run_demo"]
