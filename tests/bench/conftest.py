"""Bench tests build tiny zoo models into a per-session cache, so they never touch the user's cache."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="session", autouse=True)
def zoo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
  path = tmp_path_factory.mktemp("zoo")
  mp = pytest.MonkeyPatch()
  mp.setenv("ORTFUSE_CACHE_DIR", str(path))
  yield path
  mp.undo()
