"""The data tests' tokenize cache lives in this session's temporary directory, not the user's
(~/.cache/relaytrain/data): a test sees only entries the tests made, and leaves none behind."""

from __future__ import annotations

import importlib.util

import pytest

from relaytrain.data import cache

# The GPU machine of `make test-gpu` has no `datasets` (relaytrain imports it lazily): these modules
# import it at their top, so there they are left uncollected rather than stopping the collection.
if importlib.util.find_spec("datasets") is None:
    collect_ignore = ["test_data_sources.py", "test_mixtures.py", "test_record_forms.py", "test_streaming.py"]


@pytest.fixture(autouse=True)
def _session_cache_dir(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.getbasetemp() / "data_cache"
    monkeypatch.setattr(cache, "default_dir", lambda: root)
    yield root
