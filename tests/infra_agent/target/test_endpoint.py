"""EndpointTarget and open_target: the same surface whichever kind the workspace names."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from infra_agent.errors import ConfigError, TargetError
from infra_agent.target import EndpointTarget, ServerProcess, free_port, group_members, open_target
from infra_agent.workspace import EndpointTargetSpec, ServerTargetSpec, load_workspace

HTTP_SERVER = [sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"]


@pytest.fixture
def http_server(tmp_path: Path, reap: list[int]):
    spec = ServerTargetSpec(kind="server", command=HTTP_SERVER, ready_url="/", ready_timeout_s=20)
    with ServerProcess(spec, {}, tmp_path / "logs", root=tmp_path) as server:
        assert server.pid is not None
        reap.append(server.pid)
        yield server


def test_endpoint_that_answers_is_alive(http_server: ServerProcess) -> None:
    spec = EndpointTargetSpec(kind="endpoint", url=http_server.url, metrics_url="/metrics", model="m")
    with EndpointTarget(spec) as endpoint:
        # /v1/models is a 404 on http.server: any HTTP answer proves it listens
        endpoint.check_alive()
        assert endpoint.url == http_server.url
        assert endpoint.metrics_url == http_server.url + "/metrics"
        assert endpoint.model == "m" and endpoint.pid is None and endpoint.log_tail() == ""


def test_endpoint_ready_url_must_answer_200(http_server: ServerProcess) -> None:
    spec = EndpointTargetSpec(kind="endpoint", url=http_server.url, ready_url="/no-such-page")
    with pytest.raises(TargetError, match="HTTP 404, expected 200"):
        EndpointTarget(spec).check_alive()


def test_unreachable_endpoint_is_a_target_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(TargetError) as info:
        with EndpointTarget(EndpointTargetSpec(kind="endpoint", url=url), timeout_s=2):
            pass
    assert url in str(info.value) and "unreachable" in str(info.value)


def test_open_target_launches_a_server_workspace(tmp_path: Path, reap: list[int]) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "knob.txt").write_text("from the knob")
    (tmp_path / "infra-agent.yaml").write_text(
        "target:\n"
        "  kind: server\n"
        f"  command: [{sys.executable}, -m, http.server, '{{port}}', --bind, 127.0.0.1, --directory, '{{site}}']\n"
        "  ready_url: /\n"
        "knobs:\n"
        "  site: {type: str, default: nowhere}\n"
    )
    ws = load_workspace(tmp_path)
    with open_target(ws, ws.resolve_knobs({"site": str(tmp_path / "site")}), tmp_path / "logs") as target:
        assert isinstance(target, ServerProcess) and target.pgid is not None
        reap.append(target.pgid)
        assert httpx.get(target.url + "/knob.txt", trust_env=False).text == "from the knob"
    assert group_members(target.pgid) == []


def test_open_target_reaches_an_endpoint_workspace(tmp_path: Path, http_server: ServerProcess) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "infra-agent.yaml").write_text(
        f"target: {{kind: endpoint, url: '{http_server.url}'}}\nknobs:\n  n: {{type: int, default: 1}}\n"
    )
    ws = load_workspace(tmp_path / "ws")
    with open_target(ws, None, tmp_path / "logs") as target:
        assert isinstance(target, EndpointTarget) and target.url == http_server.url
    # a knob change cannot reach a server someone else runs: refuse instead of measuring the old one
    with pytest.raises(ConfigError, match="knobs changed: n"):
        with open_target(ws, ws.resolve_knobs({"n": "2"}), tmp_path / "logs"):
            pass
