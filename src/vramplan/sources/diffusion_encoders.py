"""The frozen VAE and text encoder that diffusers' ``train_text_to_image.py`` runs in every
step (``--diffusion-encoders frozen``).

That script loads the VAE and the CLIP text encoder, freezes them
(``requires_grad_(False)``), moves them to the GPU in the weight dtype of the run (fp16
under ``--mixed_precision fp16``, bf16 under bf16, else fp32) and, in every step, encodes
the pixel batch (``vae.encode(pixels).latent_dist.sample() * scaling_factor``) and the
token ids (``text_encoder(input_ids)[0]``) before the UNet's forward. Neither keeps a
graph: their weights sit on the card for the whole run, their activations only while
they run. The configs are bundled for Stable Diffusion 1.5 and 2.1
(``data/diffusers/encoders/``); for a config path inside a diffusers pipeline folder,
``vae/config.json`` and ``text_encoder/config.json`` beside ``unet/`` are read.

>>> configs = encoder_configs("sd15-unet")
>>> configs.vae["latent_channels"], configs.text_encoder["hidden_size"]
(4, 768)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vramplan.errors import UserError

ENCODERS = Path(__file__).resolve().parent.parent / "data" / "diffusers" / "encoders"
TRAIN_TIMESTEPS = 1000  # DDPMScheduler's num_train_timesteps


@dataclass(frozen=True)
class EncoderConfigs:
    """The VAE's and the text encoder's configs, and where they were read."""

    vae: dict
    text_encoder: dict
    source: str


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a JSON object is needed")
    return data


def encoder_configs(name: str) -> EncoderConfigs:
    """The frozen encoders for a bundled UNet name or a UNet config path in a pipeline."""
    bundled = ENCODERS / f"{name.removesuffix('-unet')}.json"
    if bundled.exists():
        data = _read(bundled)
        return EncoderConfigs(data["vae"], data["text_encoder"], data["_source"])
    path = Path(name)
    unet_folder = path if path.is_dir() else path.parent
    root = unet_folder.parent
    vae, text = root / "vae" / "config.json", root / "text_encoder" / "config.json"
    if not (vae.exists() and text.exists()):
        bundled_names = ", ".join(sorted(f"{p.stem}-unet" for p in ENCODERS.glob("*.json")))
        raise UserError(
            f"--diffusion-encoders frozen needs the VAE and text encoder configs: bundled for "
            f"{bundled_names}, or vae/config.json and text_encoder/config.json beside the "
            f"unet folder of {name!r}"
        )
    return EncoderConfigs(_read(vae), _read(text), str(root))


class TextToImageModels(nn.Module):
    """The UNet being trained beside the frozen VAE and text encoder, which stay in eval
    mode (as ``from_pretrained`` leaves them) whatever ``train()`` is asked."""

    def __init__(self, unet: nn.Module, vae: nn.Module, text_encoder: nn.Module) -> None:
        super().__init__()
        self.unet = unet
        self.vae = vae.requires_grad_(False)
        self.text_encoder = text_encoder.requires_grad_(False)

    def train(self, mode: bool = True) -> TextToImageModels:
        self.training = mode
        self.unet.train(mode)
        self.vae.eval()
        self.text_encoder.eval()
        return self


def build_frozen_encoders(
    configs: EncoderConfigs, dtype: torch.dtype, device: str
) -> tuple[nn.Module, nn.Module]:
    """The VAE and the CLIP text encoder, without weights, in the run's weight ``dtype``."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel

    vae_kwargs = {k: v for k, v in configs.vae.items() if not k.startswith("_")}
    text_kwargs = {k: v for k, v in configs.text_encoder.items() if not k.startswith("_")}
    try:
        with torch.device(device):
            vae = diffusers.AutoencoderKL(**vae_kwargs)
            text_encoder = CLIPTextModel(CLIPTextConfig(**text_kwargs))
    except (TypeError, ValueError) as exc:
        raise UserError(f"frozen encoders from {configs.source} cannot be built: {exc}") from None
    # nn.Module.to: diffusers' own `to` warns about keeping modules in float32 (none here)
    return nn.Module.to(vae, dtype), text_encoder.to(dtype)


def encode_step(
    models: TextToImageModels, pixels: torch.Tensor, input_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The script's step up to the UNet: (noisy latents, timesteps, text states, noise)."""
    with torch.no_grad():
        posterior = models.vae.encode(pixels.to(dtype)).latent_dist
        latents = posterior.sample() * models.vae.config.scaling_factor
        states = models.text_encoder(input_ids, return_dict=False)[0]
    noise = torch.randn_like(latents)
    batch = latents.shape[0]
    timesteps = torch.randint(0, TRAIN_TIMESTEPS, (batch,), device=latents.device)
    # DDPMScheduler.add_noise: per-sample sqrt(alpha_bar) and sqrt(1 - alpha_bar)
    signal = torch.rand(batch, 1, 1, 1, dtype=latents.dtype, device=latents.device)
    spread = torch.rand(batch, 1, 1, 1, dtype=latents.dtype, device=latents.device)
    noisy = signal * latents + spread * noise
    return noisy, timesteps, states, noise
