"""Fixtures shared by test modules."""

import os

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for tiny models (restored after): they gain nothing from more, and on a shared
    2-core machine OpenMP's waiting threads made each op up to 30x slower (4.6 min for the training and
    interference tests vs 45 s). Modules use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``privateuse1`` need the DirectML-like backend built from tests/privateuse1: without a C++
    compiler or ninja they skip, saying which is missing; under CI (which installs both) they run and fail."""
    marked = [item for item in items if item.get_closest_marker("privateuse1")]
    if not marked or os.environ.get("CI"):
        return
    from privateuse1 import unavailable

    reason = unavailable()
    if reason is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))
