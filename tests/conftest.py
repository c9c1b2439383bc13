"""Fixtures the pytest files share: `calls` (the library replaced by tests/stand_in.py, recording
each call) and `fresh_dynamo` (torch.compile's caches reset around a test)."""
import pytest


@pytest.fixture
def calls(monkeypatch):
    import stand_in  # after the test module has put python/ on sys.path
    return stand_in.install(monkeypatch)


@pytest.fixture
def fresh_dynamo():
    """Each test compiles from scratch (the same module compiled by many tests would otherwise
    fill dynamo's cache and fall back to eager)."""
    import torch
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
