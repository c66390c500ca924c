"""Fixtures for the model tests: every module runs torch with one thread."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The machine is shared (CI has 2 cores): one thread is plenty for models this size."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
