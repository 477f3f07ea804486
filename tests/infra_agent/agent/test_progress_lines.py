"""What the run's progress lines say about the servers a job uses: a kept server is attached, not started."""

from __future__ import annotations

from infra_agent.mcp.progress import describe_event

from .fake_executor import Lines


def test_a_kept_server_is_said_attached_and_a_launch_is_said_started() -> None:
    progress = Lines()
    progress.event({"event": "start", "side": "a", "kept": True})
    progress.event({"event": "start", "side": "b", "kept": False})
    progress.event({"event": "start", "side": "b"})  # a worker of an older version sends no "kept"
    assert progress.lines == ["  server A: kept up, attached", "  starting server B", "  starting server B"]
    assert describe_event({"event": "start", "side": "a", "kept": True}) == "server A: kept up, attached"
    assert describe_event({"event": "start", "side": "b"}) == "starting server B"
