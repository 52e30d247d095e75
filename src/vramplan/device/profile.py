"""Device profiles: measured runtime figures of one GPU, driver, CUDA and PyTorch
(``vramplan calibrate`` writes them), kept as JSON files that later estimates read with
``--profile PATH``, or by themselves when ``--gpu`` names the same card::

    >>> profile = DeviceProfile(gpu="A100-80GB", total_bytes=85899345920, driver="550.54",
    ...                         cuda="12.4", torch="2.5.1", cuda_context_bytes=500 * 2**20,
    ...                         cublas_workspace_bytes=8519680)
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     load_profile(save_profile(profile, Path(folder))).cuda_context_bytes
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
    cudnn_loaded: bool = True
    """Whether the measured context includes cuDNN's kernels (``calibrate`` runs a
    convolution, so it does; a floor read from a model without one does not)."""
    cublas_loaded: bool = True
    """Whether it includes cuBLAS's kernels (``calibrate`` runs a GEMM; a context read
    after one small tensor, as Hugging Face's ``torch.ones((1, 1))`` floor, does not)."""

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
