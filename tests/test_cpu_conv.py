"""The CPU target counts the scratch PyTorch's slow CPU convolution kernels allocate inside
the op (``trace/cpu_conv.py``): a traced step matches a real CPU step's peak from PyTorch's
profiler, and the kernel is the one PyTorch's own ``_select_conv_backend`` picks."""

from __future__ import annotations

import pytest
import torch
from conftest import onednn_runs
from torch import nn

from vramplan.measurement.run import measure_built
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources.user_code import module_source
from vramplan.trace.cpu_conv import ConvCall, Host, cpu_conv_backend, scratch


def slow2d() -> nn.Module:
    """Batch 1 of a small 3x3 input: ``use_mkldnn`` declines (no groups, kernel <= 3,
    batch 1, at most 20480 input elements); the last convolution is strided."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, stride=2, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )


def dilated2d() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=2, dilation=2),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=2, dilation=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )


def slow3d() -> nn.Module:
    """The 1x1x1 convolution views its input forward but takes ``fgrad_input`` backward."""
    return nn.Sequential(
        nn.Conv3d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv3d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv3d(8, 8, 1),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def dilated3d() -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(3, 8, 3, padding=2, dilation=2),
        nn.ReLU(),
        nn.Conv3d(8, 8, 3, padding=2, dilation=2),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


class Strided(nn.Module):
    """A transposed image into a convolution: ``at::_convolution`` and
    ``convolution_backward`` copy it contiguous, alive with the columns."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.conv(x.transpose(2, 3)).mean(dim=(2, 3)))


def strided() -> nn.Module:
    return Strided()


CASES = [
    (strided, (16, 24, 20), "Slow2d"),
    (slow2d, (3, 16, 16), "Slow2d"),
    (dilated2d, (3, 16, 16), "SlowDilated2d"),
    (slow3d, (3, 4, 8, 8), "Slow3d"),
    (dilated3d, (3, 4, 8, 8), "SlowDilated3d"),
]


@pytest.mark.parametrize("factory,shape,kernels", CASES, ids=[c[0].__name__ for c in CASES])
def test_traced_peak_counts_the_kernels_columns_as_a_real_cpu_step_shows(factory, shape, kernels):
    recipe = Recipe(batch_size=1, optimizer="sgd", input_shape=shape)

    def built():
        with torch.device("meta"):
            model = factory()
        return module_source(model, recipe, factory.__name__)

    estimate = estimate_built(built(), recipe, target="cpu")
    assert any(note.endswith(f": {kernels}") for note in estimate.notes), estimate.notes
    real = measure_built(built(), recipe, "cpu", steps=2).allocated_bytes
    # without the columns the trace is 55% to 83% short of these
    assert estimate.peak.allocated_bytes == pytest.approx(real, rel=0.005)


def _conv(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1, dtype=torch.float32):
    spatial = len(w_shape) - 2
    call = ConvCall(
        tuple(x_shape),
        tuple(w_shape),
        (stride,) * spatial,
        (padding,) * spatial,
        (dilation,) * spatial,
        groups=groups,
        dtype=dtype,
    )
    return call


SELECTION = [
    _conv((1, 16, 8, 8), (32, 16, 3, 3), padding=1),  # batch 1, small: Slow2d
    _conv((2, 16, 8, 8), (32, 16, 3, 3), padding=1),  # batch 2: oneDNN
    _conv((1, 16, 40, 40), (32, 16, 3, 3), padding=1),  # 25600 elements: oneDNN
    _conv((1, 16, 8, 8), (32, 16, 5, 5), padding=2),  # kernel above 3x3: oneDNN
    _conv((1, 16, 8, 8), (16, 1, 3, 3), padding=1, groups=16),  # depthwise: oneDNN
    _conv((1, 16, 8, 8), (32, 16, 3, 3), padding=2, dilation=2),  # SlowDilated2d
    _conv((2, 16, 8, 8), (32, 16, 3, 3), padding=2, dilation=2),  # oneDNN
    _conv((1, 16, 8, 8), (32, 16, 1, 1)),  # 1x1
    _conv((2, 16, 8, 8), (32, 16, 3, 3), padding=1, dtype=torch.float64),  # Slow2d
    _conv((2, 16, 8, 8), (32, 16, 3, 3), padding=2, dilation=2, dtype=torch.float64),
    _conv((2, 16, 8, 8), (32, 16, 3, 3), padding=1, dtype=torch.bfloat16),
    _conv((1, 4, 4, 8, 8), (8, 4, 3, 3, 3), padding=1),  # Slow3d
    _conv((2, 4, 4, 8, 8), (8, 4, 3, 3, 3), padding=1),  # oneDNN
    _conv((1, 4, 4, 8, 8), (8, 4, 3, 3, 3), padding=2, dilation=2),  # SlowDilated3d
    _conv((2, 4, 4, 8, 8), (8, 2, 3, 3, 3), padding=1, groups=2, dtype=torch.float64),
    _conv((1, 16, 64), (32, 16, 3), padding=1),  # 1-d, viewed as 2-d: Slow2d
    _conv((4, 16, 64), (32, 16, 3), padding=1),  # oneDNN
]


@pytest.mark.parametrize("call", SELECTION, ids=range(len(SELECTION)))
def test_the_kernel_is_the_one_pytorch_selects(call):
    x = torch.empty(call.input_shape, dtype=call.dtype)
    w = torch.empty(call.weight_shape, dtype=call.dtype)
    spatial = len(call.weight_shape) - 2
    chosen = torch._C._select_conv_backend(
        x,
        w,
        None,
        list(call.stride),
        list(call.padding),
        list(call.dilation),
        False,
        [0] * spatial,
        call.groups,
        None,
    )
    assert cpu_conv_backend(call, Host.here()) == chosen.name


def test_the_selection_reads_threads_and_the_cpus_onednn_kernels():
    """Read from ``ConvParams::use_mkldnn``: a 1x1 kernel on one thread stays native; bf16
    goes to oneDNN only where the CPU has its bf16 kernels; oneDNN switched off, none."""
    pointwise = _conv((1, 16, 8, 8), (32, 16, 1, 1))
    assert cpu_conv_backend(pointwise, Host(threads=1)) == "Slow2d"
    assert cpu_conv_backend(pointwise, Host(threads=1, mkldnn=False)) == "Slow2d"
    large = _conv((1, 16, 64, 64), (32, 16, 1, 1))
    assert cpu_conv_backend(large, Host(threads=1)) == "Slow2d"
    assert cpu_conv_backend(large, Host(threads=2)) == "Mkldnn"
    bf16 = _conv((1, 16, 8, 8), (32, 16, 3, 3), padding=1, dtype=torch.bfloat16)
    assert cpu_conv_backend(bf16, Host(threads=2, mkldnn_bf16=True)) == "Mkldnn"
    assert cpu_conv_backend(bf16, Host(threads=2)) == "Slow2d"
    batch = _conv((2, 16, 8, 8), (32, 16, 3, 3), padding=1)
    assert cpu_conv_backend(batch, Host(threads=2, mkldnn=False)) == "Slow2d"


def test_columns_sizes_from_the_kernels_sources():
    call = _conv((2, 16, 8, 8), (32, 16, 3, 3), padding=1)
    columns = 2 * 16 * 3 * 3 * 8 * 8 * 4  # the whole batch, fp32
    assert scratch(call, "Slow2d", ("forward",))[0].nbytes == columns
    assert scratch(call, "Slow2d", ("backward_filter",))[0].nbytes == columns
    assert scratch(call, "Slow2d", ("backward_data",)) == ()  # std::make_unique, unseen
    assert scratch(_conv((2, 16, 8, 8), (32, 16, 1, 1)), "Slow2d", ("forward",)) == ()
    strided = _conv((2, 16, 8, 8), (32, 16, 1, 1), stride=2)
    assert scratch(strided, "Slow2d", ("forward",))[0].nbytes == 2 * 16 * 4 * 4 * 4
    dilated = _conv((2, 16, 8, 8), (32, 16, 3, 3), padding=2, dilation=2)
    one_sample = 16 * 3 * 3 * 8 * 8 * 4
    assert [b.nbytes for b in scratch(dilated, "SlowDilated2d", ("forward",))] == [one_sample]
    backward = scratch(dilated, "SlowDilated2d", ("backward_filter",), bias_grad=True)
    assert [b.nbytes for b in backward] == [one_sample, 32 * 4]
    pointwise3d = _conv((2, 8, 4, 8, 8), (8, 8, 1, 1, 1))
    assert scratch(pointwise3d, "Slow3d", ("forward",)) == ()
    assert scratch(pointwise3d, "Slow3d", ("backward_data",))[0].nbytes == 2 * 8 * 256 * 4
    assert scratch(call, "Mkldnn", ("forward",)) == ()


def test_a_tiny_retinanet_at_batch_1_matches_a_real_cpu_step():
    """Its head's 3x3 convolutions on 1x32x24x24 (18432 elements) run ``Slow2d``, and their
    ``grad_output`` comes back strided from the head's permute: the trace was 8.8% short."""
    from test_detection import RECIPE, _tiny_retinanet

    recipe = RECIPE.with_changes(focal_loss="fused", batch_size=1)
    traced = estimate_built(_tiny_retinanet(recipe), recipe, target="cpu").peak.allocated_bytes
    real = measure_built(_tiny_retinanet(recipe, "cpu"), recipe, "cpu", steps=2)
    assert traced == pytest.approx(real.allocated_bytes, rel=0.005)


@pytest.mark.xfail(
    onednn_runs("bf16"),
    reason="oneDNN's bf16 convolutions on this CPU: not modelled yet (conftest.onednn_runs)",
)
@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
def test_bf16_convolutions_match_a_real_cpu_step(precision):
    """bf16 convolutions run oneDNN only on a CPU with its bf16 kernels (AVX512-BF16, AMX);
    elsewhere ``Slow2d``, whose columns the trace was 15% short of on this machine."""
    from test_ground_truth import TinyCNN, _compare, _module_built

    recipe = Recipe(batch_size=8, optimizer="sgd", precision=precision)
    traced, real = _compare(_module_built(TinyCNN, (3, 32, 32)), recipe)
    assert traced == pytest.approx(real, rel=0.005)
