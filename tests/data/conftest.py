"""The data tests' tokenize cache lives in this session's temporary directory, not the user's
(~/.cache/relaytrain/data): a test sees only entries the tests made, and leaves none behind."""

from __future__ import annotations

import pytest

from relaytrain.data import cache


@pytest.fixture(autouse=True)
def _session_cache_dir(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.getbasetemp() / "data_cache"
    monkeypatch.setattr(cache, "default_dir", lambda: root)
    yield root
