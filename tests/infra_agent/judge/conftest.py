"""Reuse the loopback fake server fixtures of the bench tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_bench_conftest", Path(__file__).parent.parent / "bench" / "conftest.py")
assert _spec is not None and _spec.loader is not None
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)

fake_server_factory = _bench.fake_server_factory
fake_workspace = _bench.fake_workspace
