"""``vramplan calibrate``: measure what no tensor count sees on the user's own GPU.

It runs a few small CUDA operations and measures the CUDA context with the kernels a
training step loads, and cuBLAS's workspace, for this GPU, driver, CUDA and PyTorch; the
result is a ``DeviceProfile`` (``device/profile.py``)::

    profile = calibrate_device()   # needs a CUDA GPU
    profile.cuda_context_bytes     # the context with a training step's kernels loaded
"""

from __future__ import annotations

from vramplan.device.catalog import lookup_gpu
from vramplan.device.profile import DeviceProfile
from vramplan.errors import UserError
from vramplan.measurement.nvml import driver_version, nvml_used_bytes


def calibrate_device() -> DeviceProfile:
    """Measure the current CUDA device (needs a GPU)."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("calibrate needs a CUDA GPU; none is visible here")
    torch.cuda.init()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    before = torch.cuda.memory_allocated()
    a = torch.randn(256, 256, device="cuda", requires_grad=True)
    (a @ a).sum().backward()  # loads cuBLAS kernels on this thread and autograd's
    conv = torch.nn.Conv2d(8, 8, 3).cuda()
    conv(torch.randn(2, 8, 16, 16, device="cuda")).sum().backward()  # loads cuDNN
    torch.cuda.synchronize()
    tensors = a.numel() * 4 * 2 + sum(p.numel() * 4 * 2 for p in conv.parameters())
    workspace = max(0, torch.cuda.memory_allocated() - before - tensors)
    used = nvml_used_bytes()
    if used is None:
        raise UserError("calibrate needs NVML: pip install nvidia-ml-py")
    context = used - torch.cuda.memory_reserved()
    try:
        name = lookup_gpu(props.name.replace("NVIDIA ", "")).name
    except UserError:
        name = props.name
    return DeviceProfile(
        gpu=name,
        total_bytes=props.total_memory,
        driver=driver_version(),
        cuda=torch.version.cuda or "",
        torch=torch.__version__,
        cuda_context_bytes=context,
        cublas_workspace_bytes=workspace,
    )
