"""The op registry: real ATen packets, the library and autocast classes the tracer and the
device model read, and no drift from what the CUDA autocast rules install."""

from __future__ import annotations

import pytest
import torch

import vramplan
from vramplan import ops
from vramplan.ops import Autocast, Library
from vramplan.trace.cuda_autocast import policy_of, registered_ops

aten = torch.ops.aten


def _base(name: str) -> str:
    return name.removeprefix("aten::").split(".")[0]


def test_every_registered_op_is_a_real_aten_packet():
    assert len(ops.rules()) > 100
    for rule in ops.rules():
        assert hasattr(aten, rule.name), rule.name
        assert getattr(aten, rule.name) is rule.packet
        assert ops.rule(rule.packet) is ops.rule(rule.name) is rule


def test_matmul_class_covers_the_cublas_ops():
    for packet in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.linear, aten.matmul):
        assert ops.library_of(packet) is Library.MATMUL, packet
    assert ops.library_of(aten.mm.default) is Library.MATMUL  # an overload finds its packet
    assert ops.library_of(aten.add) is None
    assert ops.library_of(aten.convolution) is not Library.MATMUL


def test_convolution_class_covers_forward_and_backward():
    assert ops.library_of(aten.convolution) is Library.CONVOLUTION
    assert ops.library_of(aten.convolution_backward) is Library.CONVOLUTION
    assert ops.library_of("aten::convolution_backward.default") is Library.CONVOLUTION
    assert ops.names(library=Library.CONVOLUTION).isdisjoint(ops.names(library=Library.MATMUL))


def test_lookups_by_the_names_traces_record():
    assert ops.library_of("mm") is Library.MATMUL  # Trace.op_counts spells ops this way
    assert ops.autocast_of("aten::softmax.int") is Autocast.FP32_SET_OPT_DTYPE
    assert ops.rule("c10d::mm") is None  # another namespace is not ATen's op
    assert ops.rule("no_such_op") is None


def test_cuda_autocast_classes():
    assert ops.autocast_of(aten.layer_norm) is Autocast.FP32
    assert ops.autocast_of(aten.softmax).runs_in_fp32
    assert ops.autocast_of(aten.mm) is Autocast.LOWER_PRECISION
    assert ops.autocast_of(aten.conv2d) is Autocast.LOWER_PRECISION
    assert ops.autocast_of(aten.binary_cross_entropy) is Autocast.BANNED
    assert ops.autocast_of(aten.cat) is None  # only the CPU lists name cat


def test_registry_lower_precision_set_is_what_cuda_autocast_installs():
    cuda_ops, _ = registered_ops()
    installed = {_base(n) for n in cuda_ops if policy_of(n) is Autocast.LOWER_PRECISION}
    registry = ops.names(autocast=Autocast.LOWER_PRECISION)
    # lstm and gru reach cuDNN through _cudnn_rnn, whose AutocastCUDA kernel casts them
    assert installed == registry - {"lstm", "gru"}
    assert {"mm", "conv2d", "linear", "scaled_dot_product_attention"} <= installed


def test_every_installed_cuda_autocast_op_is_named_in_the_registry():
    cuda_ops, _ = registered_ops()
    unnamed = sorted({_base(n) for n in cuda_ops} - {r.name for r in ops.rules() if r.autocast})
    assert unnamed == []


def test_one_op_one_answer():
    with pytest.raises(ValueError, match="already"):
        ops.register([aten.mm], library=Library.CONVOLUTION)
    assert ops.library_of(aten.mm) is Library.MATMUL


def test_every_named_op_exists_in_the_pytorch_the_tests_run_on():
    """A name the installed PyTorch lacks is skipped (an older PyTorch cannot trace a newer
    op: torch 2.11 has no aten::linalg_matrix_sqrth), so a misspelt name is caught here."""
    from vramplan.ops import cuda

    lists = [cuda.MATMUL, cuda.CONVOLUTION, cuda.LOWER_PRECISION, cuda.FP32]
    lists += [cuda.FP32_SET_OPT_DTYPE, cuda.PROMOTE, cuda.BANNED]
    missing = sorted({name for names in lists for name in names if not hasattr(aten, name)})
    assert missing == []
    before = len(ops.rules())
    ops.register(["no_such_op"], library=Library.MATMUL)
    assert len(ops.rules()) == before and ops.rule("no_such_op") is None


def test_a_traced_resnet_records_cudnn_and_cublas_workspaces():
    est = vramplan.estimate("torchvision:resnet18", batch_size=2, gpu="t4")
    assert est.runtime["cudnn_workspace_largest"] > 0
    assert est.runtime["cudnn_kernels"] > 0
    assert est.runtime["cublas_workspace"] > 0 and est.runtime["cublas_kernels"] > 0
