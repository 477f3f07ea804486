"""The TP tests' shared helpers (``agreement.py``), as a fixture."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent


def _load_agreement() -> ModuleType:
    # Loaded by path: tests run with --import-mode=importlib, so this folder is not on sys.path.
    spec = importlib.util.spec_from_file_location("tp_agreement", HERE / "agreement.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


_AGREEMENT = _load_agreement()


@pytest.fixture(scope="session")
def agreement() -> ModuleType:
    return _AGREEMENT
