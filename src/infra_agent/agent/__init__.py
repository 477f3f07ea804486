"""The agent loop: experiments, planner, executors, proposers (see DESIGN.md)."""
