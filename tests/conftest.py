"""Fixtures shared by test modules."""

import os

import pytest
import torch

from shadow.devices.numerics import flushes_subnormals


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for tiny models (restored after): they gain nothing from more, and on a shared
    2-core machine OpenMP's waiting threads made each op up to 30x slower (4.6 min for the training and
    interference tests vs 45 s). Modules use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def subnormals_kept():
    """Each test starts with subnormals kept: torch 2.4's Inductor compiles its C++ with -ffast-math, and loading
    it turns on flush-to-zero for the process (what ``torch.set_flush_denormal(True)`` does), which every later
    test's subnormal arithmetic would inherit. A test that needs it on sets it itself."""
    yield
    if flushes_subnormals():
        torch.set_flush_denormal(False)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``privateuse1`` need the DirectML-like backend built from tests/privateuse1: without a C++
    compiler or ninja they skip, saying which is missing; under CI (which installs both) they run and fail. The
    backend is loaded once, before the first test."""
    marked = [item for item in items if item.get_closest_marker("privateuse1")]
    if not marked:
        return
    from privateuse1 import device, unavailable

    reason = None if os.environ.get("CI") else unavailable()
    if reason is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))
        return
    # loaded before any test runs: autograd's engine sizes its per-device queues at its first backward, and a
    # backend registered after that fails every backward on its tensors (an internal assert of engine.cpp)
    device()
