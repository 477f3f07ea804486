"""Fixtures for the ledger tests: a fresh ledger file and the model factories."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from infra_agent.ledger import Ledger

HERE = Path(__file__).parent


def _load_factories() -> ModuleType:
    # Loaded by path: tests run with --import-mode=importlib, so this folder is not on sys.path.
    spec = importlib.util.spec_from_file_location("ledger_factories", HERE / "ledger_factories.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_FACTORIES = _load_factories()


@pytest.fixture
def fx() -> ModuleType:
    """The factories module: ``fx.make_run(...)``, ``fx.make_experiment(...)``."""
    return _FACTORIES


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger(tmp_path / "ledger.db") as led:
        yield led
