"""tests/conftest.py: `gpu_exclusive` tests are skipped under pytest-xdist with several workers
(they share one GPU there), and run otherwise."""

import pytest

from tests import conftest


class FakeItem:
    def __init__(self, exclusive: bool) -> None:
        self.markers = [pytest.mark.gpu_exclusive.mark] if exclusive else []

    def get_closest_marker(self, name):
        return next((m for m in self.markers if m.name == name), None)

    def add_marker(self, marker):
        self.markers.append(marker.mark)


@pytest.mark.parametrize("workers,skipped", [(None, False), ("1", False), ("8", True)])
def test_exclusive_gpu_tests_skip_only_beside_other_workers(monkeypatch, workers, skipped):
    if workers is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    exclusive, shared = FakeItem(True), FakeItem(False)
    conftest.pytest_collection_modifyitems(None, [exclusive, shared])
    skip = exclusive.get_closest_marker("skip")
    assert (skip is not None) == skipped and shared.get_closest_marker("skip") is None
    if skipped:
        assert "-m gpu_exclusive tests/gpu" in skip.kwargs["reason"]
