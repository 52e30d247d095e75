"""The named terms of the device range: how the allocator packs the live blocks
(fragmentation), the kernel images a measured context left out (floor), and eager
loading's unknown image size."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch import nn

from vramplan.device.allocator import AllocatorConfig, Request, replay
from vramplan.device.measured import MEASURED_DIR_ENV
from vramplan.device.options import device_options
from vramplan.device.profile import DeviceProfile
from vramplan.device.replay import packed_reserved
from vramplan.device.table import runtime_table
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources.user_code import module_source

MiB = 2**20


@pytest.fixture(autouse=True)
def _no_measured_tables(tmp_path, monkeypatch):
    monkeypatch.setenv(MEASURED_DIR_ENV, str(tmp_path))


def _mlp_estimate(options, batch_size=64):
    import torch

    recipe = Recipe(batch_size=batch_size, optimizer="adamw", input_shape=(1024,))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 3000), nn.ReLU(), nn.Linear(3000, 10))
    return estimate_built(module_source(model, recipe, "mlp"), recipe, "cuda", options)


def test_packed_reserved_is_a_lower_bound_of_a_real_replay():
    """Five 3 MiB blocks share one 20 MiB segment; the middle three are freed (one 9 MiB
    free block), then 12 MiB is asked: it does not fit, so a second, exact 12 MiB segment
    opens. 32 MiB reserved for 18 MiB live at the peak: packed, 18 MiB would do."""
    three = 3 * MiB
    requests = [Request(i, three, True) for i in range(5)]
    requests += [Request(i, three, False) for i in (1, 2, 3)]
    requests += [Request(9, 12 * MiB, True)]
    result = replay(requests, AllocatorConfig())
    assert result.stats.peak_reserved == 20 * MiB + 12 * MiB
    assert result.stats.peak_allocated == 18 * MiB
    assert packed_reserved(result.stats.peak_allocated) == 18 * MiB
    assert packed_reserved(result.stats.peak_allocated) <= result.stats.peak_reserved


def test_fragmentation_term_lowers_the_low_end_to_the_packed_peak():
    """Its low side packs the allocated peak into 2 MiB pages; its high side is what the
    step's other legal orders (``device.orders``) reach above the central replay."""
    est = _mlp_estimate(device_options(gpu="a100-40gb", stack="torch2.5-cu12.4"))
    terms = est.details["range"]["terms"]
    low, high = terms["fragmentation"]
    assert low <= 0 <= high
    r_low, r_high = est.peak.reserved_range_bytes
    assert r_high >= est.peak.reserved_bytes + high
    assert r_low <= est.peak.allocated_bytes + 2 * MiB
    assert r_low <= est.peak.reserved_bytes <= r_high
    t_low, t_high = est.peak.device_total_range_bytes
    assert t_low <= est.peak.device_total_bytes <= t_high


def _profile(cublas_loaded: bool) -> DeviceProfile:
    return DeviceProfile(
        gpu="V100-16GB",
        total_bytes=0,
        driver="460.91.03",
        cuda="11.2",
        torch="1.10",
        cuda_context_bytes=1000 * MiB,
        cublas_workspace_bytes=0,
        cudnn_loaded=False,
        cublas_loaded=cublas_loaded,
    )


def test_a_context_measured_before_the_first_gemm_adds_cublas_images():
    """HF's floor is read after ``torch.ones((1, 1))``: no GEMM, no cuBLAS kernels yet.
    On an eager stack the central figure takes the table's high image size and the range
    keeps its low one; its high end is the eager image measured on the H200."""
    images = runtime_table()["kernel_images"]
    low_img, _, high_img = images["cublas_range_bytes"]
    base = device_options(gpu="v100-16gb", stack="torch1.10-cu11.2")
    without = _mlp_estimate(replace(base, profile=_profile(cublas_loaded=True)))
    bare = _mlp_estimate(replace(base, profile=_profile(cublas_loaded=False)))
    assert without.runtime["cublas_kernels"] == 0
    assert bare.runtime["cublas_kernels"] == high_img
    assert bare.peak.device_total_bytes - without.peak.device_total_bytes == high_img
    floor_low, floor_high = bare.details["range"]["terms"]["floor"]
    assert (floor_low, floor_high) == (
        low_img - high_img,
        images["eager_cublas_high_bytes"] - high_img,
    )


def test_the_verdict_note_names_a_term_that_raises_the_high_end():
    """On a card sized between the central figure and the high end, the note names what
    would settle it: here the CUDA context (floor), never fragmentation, which only
    lowers the low end."""
    stack = "torch2.5-cu12.4"
    roomy = _mlp_estimate(device_options(gpu_memory="80GiB", headroom=0.0, stack=stack))
    low, high = roomy.peak.device_total_range_bytes
    assert low < roomy.peak.device_total_bytes < high
    size = (roomy.peak.device_total_bytes + high) // 2
    tight = _mlp_estimate(device_options(gpu_memory=f"{size}B", headroom=0.0, stack=stack))
    assert tight.verdict.status == "tight"
    (note,) = [n for n in tight.notes if "high end of the range passes" in n]
    assert "CUDA context" in note and "segments" not in note


def test_a_reading_that_lowers_the_reserved_peak_raises_the_high_end_as_far():
    """Segment packing answers small changes chaotically: when the high-workspace replay
    holds 300 MiB *less* than the central one for 100 MiB more allocated (400 MiB less
    fragmentation), the fragmentation term's high side allows 400 MiB more, above the
    legal orders' 100 MiB; the low reading's smaller peak alone widens nothing."""
    from types import SimpleNamespace

    from vramplan.device.replay import _range, _Run

    def run(reserved_mib: int, allocated_mib: int) -> _Run:
        stats = SimpleNamespace(
            peak_reserved=reserved_mib * MiB, peak_allocated=allocated_mib * MiB
        )
        outside = SimpleNamespace(total=500 * MiB)
        return _Run(None, outside, SimpleNamespace(stats=stats), [], None)

    runs = {"central": run(1000, 800), "low": run(900, 700), "high": run(700, 900)}
    reserved, total, widths = _range(runs, counted_reserve=0, order_high=100 * MiB)
    assert widths["terms"]["fragmentation"][1] == 400 * MiB
    assert reserved[1] == 1400 * MiB and total[1] == 1900 * MiB
