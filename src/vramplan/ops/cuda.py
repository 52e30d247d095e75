"""CUDA's per-op rules: which ops run in cuBLAS or cuDNN, and CUDA autocast's op lists.

Autocast lists by op base name, from PyTorch ``aten/src/ATen/autocast_mode.cpp``
(``TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m)``) and the ``AT_FORALL_*`` lists of
``autocast_mode.h``. Ops the installed PyTorch registers for AutocastCUDA but that are not
named here run in fp32 (``trace/cuda_autocast.py``), as the newer entries do.
"""

from __future__ import annotations

from vramplan.ops.registry import Autocast, Library, register

# cuBLAS-backed ops: their first call in a phase creates the cuBLAS/cuBLASLt workspaces.
MATMUL = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "matmul",
    "linear",
    "addmv",
    "mv",
    "_scaled_mm",
    "addbmm",
)

# cuDNN convolutions: each call records a workspace marker in the trace.
CONVOLUTION = (
    "convolution",
    "convolution_backward",
    "cudnn_convolution",
    "_convolution",
    "convolution_overrideable",
)

LOWER_PRECISION = (
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convolution",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    "_cudnn_rnn",
    "lstm",
    "gru",
)
# AT_FORALL_FP32 and the CUDA-only fp32 entries (pow, norm, rms_norm, ...), as the AutocastCUDA
# kernels of torch 2.14 name them.
FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "rms_norm",
    "norm",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "linalg_matrix_sqrth",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = (
    "prod",
    "softmax",
    "log_softmax",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "sum",
)
PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
    "vdot",
)
BANNED = ("binary_cross_entropy",)

register(MATMUL, library=Library.MATMUL)
register(CONVOLUTION, library=Library.CONVOLUTION)
register(LOWER_PRECISION, autocast=Autocast.LOWER_PRECISION)
register(FP32, autocast=Autocast.FP32)
register(FP32_SET_OPT_DTYPE, autocast=Autocast.FP32_SET_OPT_DTYPE)
register(PROMOTE, autocast=Autocast.PROMOTE)
register(BANNED, autocast=Autocast.BANNED)
