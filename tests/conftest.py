"""Fixtures shared by test modules."""

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
