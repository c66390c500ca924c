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


def test_placed_copies_a_large_tensor_into_huge_pages_and_leaves_a_small_one(monkeypatch):
    large = torch.arange(4 * 2**20, dtype=torch.int32).view(2**10, 2**12).t()  # 16 MiB, not contiguous
    copy = huge_pages.placed(large)
    assert copy.is_contiguous() and copy.data_ptr() % huge_pages.HUGE_PAGE == 0 and torch.equal(copy, large)
    small = torch.ones(16, 16)
    assert huge_pages.placed(small) is small
    tune(monkeypatch, "huge-pages=off")
    monkeypatch.setattr(huge_pages, "anonymous", lambda nbytes: pytest.fail("a mapping advised with huge-pages=off"))
    assert torch.equal(huge_pages.placed(large), large)


def test_a_q8_0_weight_quantized_at_load_sits_in_huge_pages():
    """A weight requantized in tensor ops (an AVX2 CPU's Q6_K and 5-bit types, `_requantized`) lands in 2 MiB pages
    as the weights the kernels pack do, with the values it had in PyTorch's pages."""
    from kettle.quantization import q8
    from kettle.quantization.q8 import Q8Linear

    weight = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0))  # 4 MiB of int8
    layer = Q8Linear.from_weight(weight)
    q, scales = q8.quantize_blocks(weight)
    assert torch.equal(layer.stored()[0], q) and torch.equal(layer.stored()[1], scales)
    assert layer.q.data_ptr() % huge_pages.HUGE_PAGE == 0


def test_int8_and_int4_weights_quantized_at_load_sit_in_huge_pages(monkeypatch):
    """`--quantize int8` / `int4` quantize in tensor ops too: their weights land in 2 MiB pages, values unchanged."""
    from kettle.quantization.int8 import Int8Linear, quantize_int8
    from kettle.quantization.q4 import Q4Linear

    weight = torch.randn(2048, 4096, generator=torch.Generator().manual_seed(1))  # 8 MiB of int8, 4 MiB of int4
    int8 = Int8Linear.from_weight(weight)
    assert torch.equal(int8.q, quantize_int8(weight)[0]) and int8.q.data_ptr() % huge_pages.HUGE_PAGE == 0
    int4 = Q4Linear.from_weight(weight, group_size=32)
    assert int4.packed.data_ptr() % huge_pages.HUGE_PAGE == 0
    tune(monkeypatch, "huge-pages=off")  # PyTorch's pages: the same values
    unplaced = Q4Linear.from_weight(weight, group_size=32)
    assert torch.equal(int4.dequantized(), unplaced.dequantized())


def test_a_q6_k_weight_built_in_tensor_ops_sits_in_huge_pages(monkeypatch):
    """A Q6_K weight made from decoded values (`Q6Linear(q, scales, d)`, not packed from a file's blocks) lands in
    2 MiB pages too, with the same lanes bytes and the same dequantized values as in PyTorch's pages."""
    from kettle.quantization.q6 import Q6Linear, to_lanes

    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 64, (2048, 2048), generator=g, dtype=torch.uint8)  # 3 MiB in lanes
    scales = torch.randint(-128, 128, (2048, 2048 // 16), generator=g).to(torch.int8)
    d = (torch.rand(2048, 2048 // 256, generator=g) / 64).half()
    layer = Q6Linear(q, scales, d)
    assert layer.weight_bytes.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert torch.equal(layer.weight_bytes, to_lanes(q))
    tune(monkeypatch, "huge-pages=off")
    assert torch.equal(layer.dequantized(), Q6Linear(q, scales, d).dequantized())
