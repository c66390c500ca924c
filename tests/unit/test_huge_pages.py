"""Packed weights and the KV cache in 2 MiB pages (kettle/tensors/huge_pages.py): a large tensor is a zeroed anonymous
mapping on a 2 MiB boundary that the kernel may back with transparent huge pages, a small one PyTorch's, and
`huge-pages=off` gives PyTorch's at every size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kettle.tensors import huge_pages
from tests.fixtures import tune, vma_of

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_a_large_tensor_is_zeroed_and_starts_on_a_huge_page_boundary():
    tensor = huge_pages.zeros(3, 2**20, dtype=torch.int16)  # 6 MiB
    assert tensor.shape == (3, 2**20) and tensor.dtype == torch.int16
    assert tensor.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not tensor.any()
    empty = huge_pages.empty(2**21, dtype=torch.float32)
    assert empty.data_ptr() % huge_pages.HUGE_PAGE == 0 and empty.numel() == 2**21


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_the_kernel_may_back_a_large_tensor_with_huge_pages():
    tensor = huge_pages.empty(4 * huge_pages.HUGE_PAGE, dtype=torch.uint8)
    tensor.fill_(1)  # faults the pages in
    vma = vma_of(tensor.data_ptr())
    assert vma.get("THPeligible") == "1"
    assert int(vma["AnonHugePages"].split()[0]) >= 2048  # kB: at least one huge page (none free: the kernel's say)


def test_small_tensors_and_the_switch_off_are_pytorch_s(monkeypatch):
    small = huge_pages.zeros(16, 16, dtype=torch.float32)
    assert not small.any() and small.untyped_storage().nbytes() == 16 * 16 * 4
    tune(monkeypatch, "huge-pages=off")
    # Asked of the allocation itself: whether the kernel then backs PyTorch's memory with huge pages depends on the
    # process's history (glibc reuses its heaps), which made a check of /proc/self/smaps flaky in a shared worker.
    monkeypatch.setattr(huge_pages, "anonymous", lambda nbytes: pytest.fail("a mapping advised with huge-pages=off"))
    large = huge_pages.zeros(4 * huge_pages.HUGE_PAGE, dtype=torch.uint8)
    assert not large.any() and large.numel() == 4 * huge_pages.HUGE_PAGE
