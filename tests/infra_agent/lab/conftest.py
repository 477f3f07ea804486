"""Paths of the example specs the kernel-lab tests run."""

from __future__ import annotations

from pathlib import Path

import pytest

SPECS = Path(__file__).parent / "specs"


@pytest.fixture
def specs_dir() -> Path:
    return SPECS
