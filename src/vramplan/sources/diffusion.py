"""``diffusers:NAME``: a diffusion UNet or DiT trained on precomputed latents.

``NAME`` is a bundled config (``data/diffusers/*.json``, written from the models'
``config.json``: ``sd15-unet``, ``sd21-unet``, ``sdxl-unet``, ``dit-xl-2-256``) or a path to
a diffusers ``config.json``. The step is the diffusers training scripts' step with the
VAE latents and text embeddings precomputed: noisy latents ``(4, res/8, res/8)``, a
timestep and the text encoder's states (``--seq-len`` tokens, 77 by default; SDXL adds its
pooled embedding and six time ids; a DiT takes a class label) go in, and the loss is the
mean squared error of the predicted noise. ``--resolution`` sets the image side in pixels
(the latents are an eighth of it); ``--input-shape`` sets the latent shape itself.
With ``--diffusion-encoders frozen`` the step starts from pixels and token ids instead,
as diffusers' ``train_text_to_image.py`` runs it: the frozen VAE and text encoder encode
them in every step (``diffusion_encoders.py``; Stable Diffusion 1.5/2.1 UNets).

>>> built = build_diffusers("sd15-unet", Recipe(batch_size=4))
>>> built.default_input_shape, sum(p.numel() for p in built.model.parameters())
((4, 64, 64), 859520964)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.sources.base import Batch, BuiltModel

CONFIGS = Path(__file__).resolve().parent.parent / "data" / "diffusers"
CLASSES = ("UNet2DConditionModel", "DiTTransformer2DModel")
TEXT_TOKENS = 77  # CLIP's context length
LATENT_FACTOR = 8  # the Stable Diffusion VAE downsamples by 8


def bundled_diffusers() -> list[str]:
    """The bundled diffusion configs.

    >>> "sd15-unet" in bundled_diffusers()
    True
    """
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def _config(name: str) -> dict:
    path = CONFIGS / f"{name}.json"
    if not path.exists():
        path = Path(name)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise UserError(
                f"unknown diffusers model {name!r}: give one of {', '.join(bundled_diffusers())} "
                "or a path to a diffusers config.json"
            )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read diffusers config {path}: {exc}") from None
    if not isinstance(config, dict) or config.get("_class_name") not in CLASSES:
        raise UserError(
            f"{path}: a diffusers config with _class_name {' or '.join(CLASSES)} is needed"
        )
    return config


def _latent_shape(recipe: Recipe, config: dict) -> tuple[int, ...]:
    """The latents' CxHxW; a DiT's sides must be whole patches (its output is unpatchified
    to ``patches x patch_size``, which must meet the noise it is compared with: 264 px,
    latents 33x33 in 2x2 patches, is refused).

    >>> _latent_shape(Recipe(resolution=256), {"patch_size": 2, "in_channels": 4})
    (4, 32, 32)
    """
    if recipe.input_shape is not None:
        if len(recipe.input_shape) != 3:
            raise UserError(f"diffusion models take latents CxHxW, got {recipe.input_shape}")
        shape = recipe.input_shape
        asked = f"--input-shape {'x'.join(map(str, shape))}"
    else:
        side = (recipe.resolution or config["sample_size"] * LATENT_FACTOR) // LATENT_FACTOR
        if side <= 0 or (recipe.resolution or 0) % LATENT_FACTOR:
            raise UserError(f"--resolution must be a multiple of 8, got {recipe.resolution}")
        shape = (config["in_channels"], side, side)
        asked = f"--resolution {recipe.resolution}"
    patch = config.get("patch_size") or 1
    if shape[1] % patch or shape[2] % patch:
        raise UserError(
            f"{asked}: latents {shape[1]}x{shape[2]} are not whole {patch}x{patch} patches of "
            f"the DiT (a multiple of {patch * LATENT_FACTOR} pixels)"
        )
    return shape


def build_diffusers(name: str, recipe: Recipe, device: str = "meta") -> BuiltModel:
    """A diffusers UNet2DConditionModel or DiTTransformer2DModel, no weights."""
    from vramplan.library_logs import quiet_logger
    from vramplan.sources.vision import require_package

    diffusers = require_package("diffusers", "diffusion")
    # ModelMixin.to(dtype) logs "modules ... should be kept in float32: []" for every cast
    # (`fp32_modules = self._keep_in_fp32_modules or []`, then `is not None`); the two
    # classes built here keep none in float32, so pure bf16/fp16's cast is all it reports
    diffusers.utils.logging.set_verbosity_error()
    config = _config(name)
    if recipe.num_classes is not None:
        raise UserError(
            "--num-classes: a diffusion model has no classifier head (a DiT's class labels "
            "are its config's num_embeds_ada_norm)"
        )
    kind = config["_class_name"]
    latents = _latent_shape(recipe, config)  # before the build: a bad size fails at once
    tokens = recipe.seq_len or TEXT_TOKENS
    unet = kind == "UNet2DConditionModel"
    frozen = recipe.diffusion_encoders == "frozen"
    if frozen and (not unet or config.get("addition_embed_type") == "text_time"):
        raise UserError(
            "--diffusion-encoders frozen: the frozen VAE and CLIP text encoder are traced "
            "for Stable Diffusion 1.x/2.x UNets (SDXL's and DiT's training scripts "
            "precompute their embeddings)"
        )
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    try:
        # diffusers' quantizers import bitsandbytes where it is installed, whose CPU backend
        # warns that a kernel package for its own CPU 4-bit matmul is missing
        with torch.device(device), quiet_logger("bitsandbytes"):
            model = getattr(diffusers, kind)(**kwargs)
    except (TypeError, ValueError) as exc:
        raise UserError(f"diffusers model {name!r} cannot be built: {exc}") from None
    if frozen:
        return _with_frozen_encoders(name, model, recipe, latents, tokens, device)

    def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
        noisy = torch.randn(batch_size, *latents, dtype=dtype)
        noise = torch.randn(batch_size, *latents, dtype=dtype)
        timesteps = torch.randint(0, 1000, (batch_size,))
        if not unet:
            return noisy, timesteps, {"class_labels": torch.randint(0, 1000, (batch_size,))}, noise
        states = torch.randn(batch_size, tokens, config["cross_attention_dim"], dtype=dtype)
        extra = {"encoder_hidden_states": states}
        if config.get("addition_embed_type") == "text_time":  # SDXL
            pooled = config["projection_class_embeddings_input_dim"] - 6 * config.get(
                "addition_time_embed_dim", 256
            )
            extra["added_cond_kwargs"] = {
                "text_embeds": torch.randn(batch_size, pooled, dtype=dtype),
                "time_ids": torch.randn(batch_size, 6, dtype=dtype),
            }
        return noisy, timesteps, extra, noise

    def run(module: nn.Module, batch: Batch, training: bool):
        noisy, timesteps, extra, noise = batch
        predicted = module(noisy, timesteps, **extra).sample
        if not training:
            return predicted
        # a DiT predicts the noise and its variance: the loss reads the noise half
        predicted = predicted[:, : noise.shape[1]]
        return nn.functional.mse_loss(predicted.float(), noise.float())

    return BuiltModel(
        name=f"diffusers:{name}",
        architecture=kind,
        kind="diffusion",
        model=model,
        make_batch=make_batch,
        run=run,
        default_input_shape=latents,
        enable_checkpointing=_checkpoint,
        blocks=1,
        sequence=unet,
        notes=[
            "latents and text embeddings precomputed (VAE and text encoder not on the GPU); "
            f"latents {'x'.join(map(str, latents))}"
            + (f", {tokens} text tokens" if unet else ", class-conditional")
        ],
        input_hint="check --resolution / --input-shape (latents CxHxW) / --seq-len",
    )


def _checkpoint(module: nn.Module, limit: int | None, every: int = 1, ops: bool = False) -> int:
    if limit is not None or every != 1 or ops:
        raise UserError(
            "diffusers models recompute all their blocks or none: use --checkpointing full"
        )
    getattr(module, "unet", module).enable_gradient_checkpointing()
    return 1


def _with_frozen_encoders(
    name: str, unet: nn.Module, recipe: Recipe, latents: tuple, tokens: int, device: str
) -> BuiltModel:
    """The UNet's step from pixels and token ids through the frozen VAE and text encoder."""
    from vramplan.sources.diffusion_encoders import (
        TextToImageModels,
        build_frozen_encoders,
        encode_step,
        encoder_configs,
    )

    configs = encoder_configs(name)
    weight_dtype = getattr(torch, recipe.compute_dtype_name)
    vae, text_encoder = build_frozen_encoders(configs, weight_dtype, device)
    models = TextToImageModels(unet, vae, text_encoder)
    pixels = (configs.vae["in_channels"], latents[1] * LATENT_FACTOR, latents[2] * LATENT_FACTOR)
    vocabulary = configs.text_encoder["vocab_size"]

    def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
        images = torch.rand(batch_size, *pixels, dtype=dtype)
        return images, torch.randint(0, vocabulary, (batch_size, tokens))

    def run(module: nn.Module, batch: Batch, training: bool):
        images, input_ids = batch
        noisy, timesteps, states, noise = encode_step(module, images, input_ids, weight_dtype)
        predicted = module.unet(noisy, timesteps, states).sample
        if not training:
            return predicted
        return nn.functional.mse_loss(predicted.float(), noise.float())

    return BuiltModel(
        name=f"diffusers:{name}",
        architecture="UNet2DConditionModel",
        kind="diffusion",
        model=models,
        make_batch=make_batch,
        run=run,
        default_input_shape=latents,
        enable_checkpointing=_checkpoint,
        blocks=1,
        sequence=True,
        notes=[
            f"frozen VAE and text encoder in every step ({configs.source}), in "
            f"{recipe.compute_dtype_name}, without gradients, as diffusers' "
            f"train_text_to_image.py runs them: pixels {'x'.join(map(str, pixels))}, "
            f"{tokens} text tokens"
        ],
        input_hint="check --resolution / --input-shape (latents CxHxW) / --seq-len",
    )
