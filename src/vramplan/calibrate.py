"""Calibrate the runtime model on the user's own GPU, and use the result in estimates.

``vramplan calibrate`` runs a few small CUDA operations and measures what no tensor count
sees — the CUDA context with the kernels a training step loads, and cuBLAS's workspace —
for this GPU, driver, CUDA and PyTorch, then saves a device profile. Later estimates use
it with ``--profile PATH``, or by themselves when ``--gpu`` names the same card::

    >>> profile = DeviceProfile(gpu="A100-80GB", total_bytes=85899345920, driver="550.54",
    ...                         cuda="12.4", torch="2.5.1", cuda_context_bytes=500 * 2**20,
    ...                         cublas_workspace_bytes=8519680)
    >>> load_profile(save_profile(profile, tmp_dir)).cuda_context_bytes    # doctest: +SKIP
    524288000
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from vramplan.errors import UserError

PROFILE_DIR_ENV = "VRAMPLAN_PROFILE_DIR"


@dataclass(frozen=True)
class DeviceProfile:
    """Measured runtime figures of one GPU + driver + CUDA + PyTorch combination."""

    gpu: str
    total_bytes: int
    driver: str
    cuda: str
    torch: str
    cuda_context_bytes: int
    cublas_workspace_bytes: int

    def to_json(self) -> dict:
        return {"schema": "vramplan.profile/1", **asdict(self)}


def profile_dir() -> Path:
    """Where profiles are kept: ``$VRAMPLAN_PROFILE_DIR`` or ``~/.config/vramplan/profiles``."""
    return Path(os.environ.get(PROFILE_DIR_ENV, Path.home() / ".config" / "vramplan" / "profiles"))


def _file_name(gpu: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ".json"


def save_profile(profile: DeviceProfile, folder: Path | None = None) -> Path:
    folder = folder or profile_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / _file_name(profile.gpu)
    path.write_text(json.dumps(profile.to_json(), indent=2))
    return path


def load_profile(path: str | Path) -> DeviceProfile:
    """Read a profile file (a UserError when missing or malformed)."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"device profile not found: {file}")
    try:
        data = json.loads(file.read_text())
        data.pop("schema", None)
        return DeviceProfile(**data)
    except (json.JSONDecodeError, TypeError) as exc:
        raise UserError(f"malformed device profile {file}: {exc}") from None


def profile_for(gpu: str) -> DeviceProfile | None:
    """The saved profile of a catalog card, if ``vramplan calibrate`` made one."""
    path = profile_dir() / _file_name(gpu)
    return load_profile(path) if path.is_file() else None


def calibrate_device() -> DeviceProfile:
    """Measure the current CUDA device (needs a GPU)."""
    import torch

    from vramplan.gpus import lookup_gpu
    from vramplan.measure import _driver_version, _nvml_used_bytes

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
    used = _nvml_used_bytes()
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
        driver=_driver_version(),
        cuda=torch.version.cuda or "",
        torch=torch.__version__,
        cuda_context_bytes=context,
        cublas_workspace_bytes=workspace,
    )
