"""The recipe of a step: batch, shapes, precision, optimizer and the other knobs.

A ``Recipe`` is validated on construction, so every later stage can trust it::

    >>> Recipe(batch_size=8, precision="amp-bf16", optimizer="adamw").param_dtype_name
    'float32'
    >>> Recipe(batch_size=0)
    Traceback (most recent call last):
    vramplan.errors.UserError: batch size must be a positive integer, got 0
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from vramplan.errors import UserError

PRECISIONS = ("fp32", "fp16", "bf16", "amp-fp16", "amp-bf16")
OPTIMIZERS = (
    "sgd",
    "momentum",
    "adam",
    "adamw",
    "adagrad",
    "rmsprop",
    "adafactor",
    "lion",
    "adam8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "none",
)
CHECKPOINTING = ("none", "full", "op")
OPTIMIZER_IMPLS = ("auto", "foreach", "for-loop", "fused")
"""How ``torch.optim`` runs the step: ``auto`` as the emulated PyTorch does by default
(foreach on CUDA since 2.0, a per-parameter loop before), or the one the user forces."""
TORCH_OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "adagrad", "rmsprop")
FUSED_OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "adagrad")
MODES = ("train", "infer", "generate")

Precision = Literal["fp32", "fp16", "bf16", "amp-fp16", "amp-bf16"]
Mode = Literal["train", "infer", "generate"]


def _choice(value: str, allowed: tuple[str, ...], what: str) -> str:
    normalised = str(value).strip().lower()
    if normalised not in allowed:
        raise UserError(f"unknown {what} {value!r}; choose one of: {', '.join(allowed)}")
    return normalised


def _checkpointing(value: str | int) -> str:
    """``none``, ``full``, a count of leading blocks to recompute (selective), ``every:N``
    (every Nth block, torchtitan's layer-level selective checkpointing) or ``op``
    (op-level selective: each block saves the outputs of torchtitan's op list).

    >>> _checkpointing("every:2"), _checkpointing("op"), _checkpointing("every:1")
    ('every:2', 'op', 'full')
    """
    text = str(value).strip().lower()
    if text.isdigit():
        return "none" if int(text) == 0 else str(int(text))
    head, sep, count = text.partition(":")
    if sep and head == "every":
        if not count.isdigit() or int(count) == 0:
            raise UserError(f"--checkpointing {value}: every:N needs a positive block count")
        return "full" if int(count) == 1 else f"every:{int(count)}"
    return _choice(text, CHECKPOINTING, "checkpointing (none, full, a block count, every:N or op)")


@dataclass(frozen=True)
class Recipe:
    """Every knob of one training or inference step.

    ``input_shape`` is the shape of one sample without the batch dimension
    (``(3, 224, 224)`` or ``"3x224x224"`` for an image model, ``(512,)`` for token ids);
    ``None`` means
    the model's own default, and ``seq_len`` sets the token count of text models.
    """

    batch_size: int = 1
    seq_len: int | None = None
    input_shape: tuple[int, ...] | None = None
    precision: Precision = "fp32"
    optimizer: str = "adamw"
    checkpointing: str = "none"
    grad_accum: int = 1
    mode: Mode = "train"
    optimizer_impl: str = "auto"
    extras: dict[str, Any] = field(default_factory=dict)
    # Fine-tuning (sources/finetune.py): LoRA through peft, bitsandbytes layouts, freezing.
    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: str | None = None
    freeze: str | None = None
    train_only: str | None = None
    quantize: str = "none"
    double_quant: bool = False
    compute_dtype: str | None = None
    bnb_version: str | None = None
    # int4 checkpoints (--quantize gptq|awq, sources/int4.py): group size, kernel, act-order.
    group_size: int | None = None
    quant_kernel: str | None = None
    act_order: bool = False
    # Generation (--mode generate, trace/generate.py): prompt, new tokens, cache, beams.
    prompt_len: int | None = None
    new_tokens: int | None = None
    cache: str = "dynamic"
    num_beams: int = 1
    # Quantized KV cache (--cache quanto|hqq|fp8, sources/kv_quant.py): None: transformers'.
    kv_bits: int | None = None
    kv_group_size: int | None = None
    kv_residual_length: int | None = None
    # Vision tasks (sources/detection.py): targets per image and the data-dependent counts.
    boxes_per_image: int = 20
    # detection: the last image of each batch holds this many boxes instead (the busiest
    # image of a run, on which max_memory_allocated over the run peaks; last, as the
    # per-image loops then hold the other images' tensors)
    busiest_image_boxes: int | None = None
    detection_counts: str = "max"
    # detection: the targets on the GPU beyond what the model needs ("masks": a mask per
    # box in every target, as torchvision's reference scripts load COCO)
    targets_on_gpu: str = "model"
    # detection: torchvision < 0.5's AnchorGenerator kept the anchors of every padded batch
    # shape it met (sources/anchor_cache.py)
    anchor_cache: bool = False
    # detection: the ImageNet-initialised backbone's normalisation, "frozen"
    # (FrozenBatchNorm2d: torchvision, detectron2) or "eval" (nn.BatchNorm2d held in eval
    # mode: mmdetection's norm_eval; it keeps its input for backward)
    backbone_norm: str = "frozen"
    # detection (RetinaNet): torchvision's op-by-op focal loss, or one fused kernel as
    # mmcv's (sources/focal_loss.py)
    focal_loss: str = "ops"
    resolution: int | None = None  # diffusion (sources/diffusion.py): image side in pixels
    frames: int | None = None  # video (sources/vision.py): frames per clip
    # diffusion: VAE latents and text states precomputed, or the frozen encoders in the step
    diffusion_encoders: str = "precomputed"
    # How the named model is built and fed (sources/): attention kernel, expert routing,
    # decoder length, classes of the head.
    attention: str | None = None
    moe_routing: str = "balanced"
    experts: str | None = None
    target_len: int | None = None
    num_classes: int | None = None
    # Recipe tricks (trace/tricks.py, sources/loss.py): torchtune's and Liger's memory savers.
    optimizer_in_backward: bool = False
    activation_offload: bool = False
    loss_chunks: int = 0
    fused_ce: bool = False
    packing: bool = False
    dora: bool = False
    # torch.compile (trace/compiled.py): each repeated block and the per-chunk loss run as
    # AOTAutograd's min-cut partition runs them (torchtune's compile_model / compile_loss).
    compile: bool = False
    # What zero_grad() does between steps (trace/loop.py): "auto" is the emulated PyTorch's
    # default (None from 2.0, zeros before: data/runtime.json zero_grad).
    zero_grad: str = "auto"
    # How a framework stores and casts (trace/step.py, sources/loss.py): Hugging Face's
    # torch_dtype under bf16=True autocast, fp32 islands (peft adapters, TRL's norms),
    # transformers < 4.49's loss (without the fp32 upcast in models that kept their own,
    # gpt_bigcode and GPT-2 in 4.48); transformers 4.x encoders' always-added attention mask;
    # transformers 4.x gpt_bigcode's key/value cache, returned in training too; K and V
    # repeated to every query head before SDPA (transformers < 4.54, torchtune).
    weights_dtype: str | None = None
    keep_fp32: str | None = None
    loss_shift_copy: bool = False
    loss_no_upcast: bool = False
    additive_mask: bool = False
    kv_in_training: bool = False
    repeat_kv: bool = False
    # transformers 4.x's gradient checkpointing (no gradient_checkpointing_kwargs): reentrant.
    # Traced as non-reentrant (the same bytes per block); it decides what FSDP1 holds
    # (distributed/fsdp.py, fsdp1_held_blocks).
    reentrant: bool = False

    def __post_init__(self) -> None:
        if (
            not isinstance(self.batch_size, int)
            or isinstance(self.batch_size, bool)
            or self.batch_size <= 0
        ):
            raise UserError(f"batch size must be a positive integer, got {self.batch_size}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len <= 0):
            raise UserError(f"sequence length must be a positive integer, got {self.seq_len}")
        if isinstance(self.input_shape, str):
            object.__setattr__(self, "input_shape", parse_shape(self.input_shape))
        if self.input_shape is not None:
            shape = tuple(self.input_shape)
            if not shape or any(not isinstance(d, int) or d <= 0 for d in shape):
                raise UserError(f"input shape must be positive integers, got {self.input_shape}")
            object.__setattr__(self, "input_shape", shape)
        if not isinstance(self.grad_accum, int) or self.grad_accum <= 0:
            raise UserError(
                f"gradient accumulation must be a positive integer, got {self.grad_accum}"
            )
        object.__setattr__(self, "precision", _choice(self.precision, PRECISIONS, "precision"))
        object.__setattr__(self, "optimizer", _choice(self.optimizer, OPTIMIZERS, "optimizer"))
        object.__setattr__(self, "checkpointing", _checkpointing(self.checkpointing))
        object.__setattr__(self, "mode", _choice(self.mode, MODES, "mode"))
        if self.mode != "train":
            if self.checkpointing != "none":
                raise UserError(
                    f"--checkpointing {self.checkpointing} recomputes activations in backward; "
                    f"--mode {self.mode} has no backward"
                )
            object.__setattr__(self, "optimizer", "none")
        _check_optimizer_impl(self)
        _check_finetune(self)
        _check_int4(self)
        _check_generation(self)
        _check_vision(self)
        _check_model_inputs(self)
        _check_tricks(self)
        object.__setattr__(self, "zero_grad", _choice(self.zero_grad, ZERO_GRAD, "zero_grad"))
        _check_storage(self)

    @property
    def checkpoint_blocks(self) -> int | None:
        """How many leading blocks may recompute: ``None`` for all (``full``, ``every:N``,
        ``op``), 0 for none."""
        if self.checkpointing in ("full", "op") or self.checkpointing.startswith("every:"):
            return None
        return 0 if self.checkpointing == "none" else int(self.checkpointing)

    @property
    def checkpoint_every(self) -> int:
        """Of the blocks that may recompute, every Nth does (``every:N``; else 1)."""
        head, _, count = self.checkpointing.partition(":")
        return int(count) if head == "every" else 1

    @property
    def checkpoint_ops(self) -> bool:
        """Op-level selective checkpointing: a block saves the outputs of the ops on
        torchtitan's list and recomputes the rest."""
        return self.checkpointing == "op"

    def recomputed_blocks(self, blocks: int) -> int:
        """How many of ``blocks`` repeated blocks recompute in backward.

        >>> Recipe(checkpointing="every:2").recomputed_blocks(5)
        2
        """
        if self.checkpointing == "none" or not self.is_training:
            return 0
        limit = self.checkpoint_blocks
        return min(blocks, limit if limit is not None else blocks) // self.checkpoint_every

    @property
    def is_training(self) -> bool:
        return self.mode == "train"

    @property
    def uses_autocast(self) -> bool:
        return self.precision.startswith("amp-")

    @property
    def param_dtype_name(self) -> str:
        """The dtype parameters are stored in: fp32 unless pure fp16/bf16 training or
        ``weights_dtype`` (a model loaded in bf16 and trained under autocast)."""
        if self.weights_dtype:
            return STORAGE_DTYPES[self.weights_dtype]
        return {"fp16": "float16", "bf16": "bfloat16"}.get(self.precision, "float32")

    @property
    def compute_dtype_name(self) -> str:
        """The dtype matmuls run in."""
        return {
            "fp16": "float16",
            "amp-fp16": "float16",
            "bf16": "bfloat16",
            "amp-bf16": "bfloat16",
        }.get(self.precision, "float32")

    def with_changes(self, **changes: Any) -> Recipe:
        """A copy with some knobs changed (validated again)."""
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["input_shape"] = list(self.input_shape) if self.input_shape else None
        if not data["extras"]:
            data.pop("extras")
        if data["optimizer_impl"] == "auto":
            data.pop("optimizer_impl")
        if data["zero_grad"] == "auto":
            data.pop("zero_grad")
        for name, default in {
            **FINETUNE_DEFAULTS,
            **GENERATION_DEFAULTS,
            **INT4_DEFAULTS,
            **VISION_DEFAULTS,
            **TRICK_DEFAULTS,
            **STORAGE_DEFAULTS,
        }.items():  # absent unless asked for
            if data[name] == default:
                data.pop(name)
        for name, default in MODEL_INPUT_DEFAULTS.items():
            if data[name] == default:
                data.pop(name)
        return data


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse '3x224x224', '3,224,224' or '512' into a shape tuple.

    >>> parse_shape("3x224x224")
    (3, 224, 224)
    """
    parts = str(text).replace(",", "x").replace("X", "x").split("x")
    if any(not p.strip() for p in parts) and str(text).strip():
        raise UserError(f"cannot read shape {text!r}: a size is missing (use 3x224x224)")
    parts = [p for p in parts if p.strip()]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise UserError(
            f"cannot read shape {text!r}: use sizes joined by x, such as 3x224x224"
        ) from None
    if not shape or any(d <= 0 for d in shape):
        raise UserError(f"cannot read shape {text!r}: every size must be a positive integer")
    return shape


def _check_optimizer_impl(recipe: Recipe) -> None:
    """``--optimizer-impl`` names a way ``torch.optim`` itself runs; fused needs a kernel."""
    impl = _choice(recipe.optimizer_impl, OPTIMIZER_IMPLS, "optimizer implementation")
    object.__setattr__(recipe, "optimizer_impl", impl)
    if impl == "auto" or recipe.optimizer == "none":
        return
    if recipe.optimizer not in TORCH_OPTIMIZERS:
        raise UserError(
            f"--optimizer-impl {impl} applies to torch.optim optimizers "
            f"({', '.join(TORCH_OPTIMIZERS)}), not {recipe.optimizer}"
        )
    if impl == "fused" and recipe.optimizer not in FUSED_OPTIMIZERS:
        raise UserError(
            f"PyTorch has no fused {recipe.optimizer}; fused runs {', '.join(FUSED_OPTIMIZERS)}"
        )


QUANTIZE = ("none", "nf4", "fp4", "int8", "gptq", "awq", "fp8")
BITSANDBYTES = ("nf4", "fp4", "int8")
COMPUTE_DTYPES = ("bf16", "fp16", "fp32")
FINETUNE_DEFAULTS = {
    "lora_rank": 0,
    "lora_alpha": None,
    "lora_dropout": 0.0,
    "lora_targets": None,
    "freeze": None,
    "train_only": None,
    "quantize": "none",
    "double_quant": False,
    "compute_dtype": None,
    "bnb_version": None,
}


def _check_finetune(recipe: Recipe) -> None:
    """Validate the fine-tuning knobs (LoRA, quantization, freezing) in place."""
    rank = recipe.lora_rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise UserError(f"LoRA rank must be a non-negative integer, got {rank}")
    if recipe.lora_alpha is not None and (
        isinstance(recipe.lora_alpha, bool)
        or not isinstance(recipe.lora_alpha, (int, float))
        or recipe.lora_alpha <= 0
    ):
        raise UserError(f"LoRA alpha must be a positive number, got {recipe.lora_alpha}")
    dropout = recipe.lora_dropout
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise UserError(f"LoRA dropout must be in [0, 1), got {dropout}")
    for name in ("lora_targets", "freeze", "train_only"):
        value = getattr(recipe, name)
        if value is not None and (not isinstance(value, str) or not value.strip(" ,")):
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} needs comma-separated names or patterns, got {value!r}")
    if not rank and (recipe.lora_alpha is not None or recipe.lora_targets or dropout):
        raise UserError("--lora-alpha, --lora-dropout and --lora-targets need --lora R")
    object.__setattr__(recipe, "quantize", _choice(recipe.quantize, QUANTIZE, "quantization"))
    if recipe.compute_dtype is not None:
        object.__setattr__(
            recipe, "compute_dtype", _choice(recipe.compute_dtype, COMPUTE_DTYPES, "compute dtype")
        )
    if recipe.quantize == "none" and (recipe.double_quant or recipe.compute_dtype):
        raise UserError("--double-quant and --compute-dtype need --quantize nf4|fp4|int8")
    if recipe.quantize == "int8" and recipe.double_quant:
        raise UserError("--double-quant applies to 4-bit (nf4, fp4) weights, not int8")
    if recipe.bnb_version is not None:
        _check_bnb_version(recipe)
    if recipe.quantize in ("gptq", "awq", "fp8") and recipe.double_quant:
        raise UserError("--double-quant is bitsandbytes' (nf4, fp4); gptq/awq/fp8 do not take it")


def _check_bnb_version(recipe: Recipe) -> None:
    """``--bnb-version MAJOR.MINOR``: the bitsandbytes release whose 4-bit matmul is
    emulated (``sources/quantized.py``); it needs 4-bit weights."""
    text = str(recipe.bnb_version).strip()
    parts = text.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        raise UserError(f"--bnb-version {text!r}: give a release such as 0.41 or 0.50")
    if recipe.quantize not in ("nf4", "fp4"):
        raise UserError(
            "--bnb-version changes how 4-bit weights dequantize: add --quantize nf4|fp4"
        )
    object.__setattr__(recipe, "bnb_version", ".".join(parts[:2]))


# -- int4 checkpoints (--quantize gptq|awq) -------------------------------------------------

INT4_DEFAULTS = {"group_size": None, "quant_kernel": None, "act_order": False}


def _check_int4(recipe: Recipe) -> None:
    """Validate the GPTQ/AWQ knobs in place: they need ``--quantize gptq|awq`` and an
    inference mode (the kernels are modelled for inference only)."""
    if recipe.quantize == "fp8" and (recipe.mode == "train" or recipe.lora_rank):
        raise UserError(
            "--quantize fp8 is modelled for inference: use --mode infer or --mode generate"
        )
    if recipe.quantize not in ("gptq", "awq"):
        asked = [
            "--" + name.replace("_", "-")
            for name, default in INT4_DEFAULTS.items()
            if getattr(recipe, name) != default
        ]
        if asked:
            raise UserError(f"{', '.join(asked)} need --quantize gptq|awq")
        return
    if recipe.mode == "train" or recipe.lora_rank:
        raise UserError(
            f"--quantize {recipe.quantize} is modelled for inference: use --mode infer or "
            "--mode generate (and no LoRA)"
        )
    if recipe.quant_kernel is not None:
        object.__setattr__(recipe, "quant_kernel", str(recipe.quant_kernel).strip().lower())


# -- generation (--mode generate) -----------------------------------------------------------

CACHES = ("dynamic", "static", "quanto", "hqq", "fp8")
QUANTIZED_CACHES = ("quanto", "hqq", "fp8")
GENERATION_DEFAULTS = {
    "prompt_len": None,
    "new_tokens": None,
    "cache": "dynamic",
    "num_beams": 1,
    "kv_bits": None,
    "kv_group_size": None,
    "kv_residual_length": None,
}
DEFAULT_NEW_TOKENS = 256


def _positive(value: object, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"{what} must be a positive integer, got {value}")


def _check_generation(recipe: Recipe) -> None:
    """Validate the generation knobs in place: they belong to ``--mode generate``, whose
    prompt is ``prompt_len`` (else ``seq_len``) tokens and whose cache holds
    ``prompt_len + new_tokens - 1`` tokens at the last decode step."""
    object.__setattr__(recipe, "cache", _choice(recipe.cache, CACHES, "cache"))
    asked = [
        "--" + name.replace("_", "-")
        for name, default in GENERATION_DEFAULTS.items()
        if getattr(recipe, name) != default
    ]
    if recipe.mode != "generate":
        if asked:
            raise UserError(f"{', '.join(asked)} need --mode generate")
        return
    for name in ("prompt_len", "new_tokens"):
        if getattr(recipe, name) is not None:
            _positive(getattr(recipe, name), name.replace("_", " "))
    _positive(recipe.num_beams, "the number of beams")
    kv_knobs = {n: getattr(recipe, n) for n in ("kv_bits", "kv_group_size", "kv_residual_length")}
    asked_kv = ["--" + n.replace("_", "-") for n, v in kv_knobs.items() if v is not None]
    for name, value in kv_knobs.items():
        if value is not None:
            _positive(value, "--" + name.replace("_", "-"))
    if asked_kv and recipe.cache in ("dynamic", "static", "fp8"):
        raise UserError(f"{', '.join(asked_kv)} need --cache quanto|hqq")
    if recipe.prompt_len is not None and recipe.seq_len not in (None, recipe.prompt_len):
        raise UserError(
            f"--seq-len {recipe.seq_len} and --prompt-len {recipe.prompt_len}: give one "
            "(the prompt length)"
        )
    if recipe.lora_rank or recipe.freeze or recipe.train_only:
        raise UserError("--mode generate runs no training: LoRA and freezing do not apply")


VISION_DEFAULTS = {
    "boxes_per_image": 20,
    "busiest_image_boxes": None,
    "detection_counts": "max",
    "targets_on_gpu": "model",
    "anchor_cache": False,
    "backbone_norm": "frozen",
    "focal_loss": "ops",
    "resolution": None,
    "frames": None,
    "diffusion_encoders": "precomputed",
}
DETECTION_COUNTS = ("max", "min")
TARGETS_ON_GPU = ("model", "masks")
BACKBONE_NORMS = ("frozen", "eval")
FOCAL_LOSSES = ("ops", "fused")
DIFFUSION_ENCODERS = ("precomputed", "frozen")


def _check_vision(recipe: Recipe) -> None:
    """Validate the vision-task knobs in place."""
    boxes = recipe.boxes_per_image
    if not isinstance(boxes, int) or isinstance(boxes, bool) or boxes < 0:
        raise UserError(f"boxes per image must be a whole number (0 or more), got {boxes}")
    busiest = recipe.busiest_image_boxes
    if busiest is not None:
        if not isinstance(busiest, int) or isinstance(busiest, bool) or busiest <= 0:
            raise UserError(f"--busiest-image-boxes must be a positive integer, got {busiest}")
        if boxes == 0:
            raise UserError(
                "--busiest-image-boxes needs --boxes-per-image of 1 or more (the other images' "
                "boxes; a batch of background images with one busy image is not modelled)"
            )
    for name in ("resolution", "frames"):
        value = getattr(recipe, name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value <= 0
        ):
            raise UserError(f"{name} must be a positive integer, got {value}")
    counts = _choice(recipe.detection_counts, DETECTION_COUNTS, "detection count policy")
    object.__setattr__(recipe, "detection_counts", counts)
    targets = _choice(recipe.targets_on_gpu, TARGETS_ON_GPU, "targets on the GPU")
    object.__setattr__(recipe, "targets_on_gpu", targets)
    norm = _choice(recipe.backbone_norm, BACKBONE_NORMS, "backbone normalisation")
    object.__setattr__(recipe, "backbone_norm", norm)
    focal = _choice(recipe.focal_loss, FOCAL_LOSSES, "focal loss")
    object.__setattr__(recipe, "focal_loss", focal)
    encoders = _choice(recipe.diffusion_encoders, DIFFUSION_ENCODERS, "diffusion encoders")
    object.__setattr__(recipe, "diffusion_encoders", encoders)


ATTENTION = ("eager", "sdpa", "flash_attention_2", "flex_attention")
MOE_ROUTING = ("balanced", "worst")
EXPERTS = ("grouped_mm", "eager", "linear")
MODEL_INPUT_DEFAULTS = {
    "attention": None,
    "moe_routing": "balanced",
    "experts": None,
    "target_len": None,
    "num_classes": None,
}


def _check_model_inputs(recipe: Recipe) -> None:
    """Validate the knobs that choose how a named model is built and fed.

    >>> Recipe(attention="Flash_Attention_2", precision="bf16").attention
    'flash_attention_2'
    >>> Recipe(moe_routing="random")
    Traceback (most recent call last):
    vramplan.errors.UserError: unknown MoE routing 'random'; choose one of: balanced, worst
    """
    if recipe.attention is not None:
        object.__setattr__(
            recipe, "attention", _choice(recipe.attention, ATTENTION, "attention implementation")
        )
    object.__setattr__(
        recipe, "moe_routing", _choice(recipe.moe_routing, MOE_ROUTING, "MoE routing")
    )
    if recipe.experts is not None:
        object.__setattr__(
            recipe, "experts", _choice(recipe.experts, EXPERTS, "experts implementation")
        )
    for name, flag in (("target_len", "--target-len"), ("num_classes", "--num-classes")):
        value = getattr(recipe, name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value <= 0
        ):
            raise UserError(f"{flag} must be a positive integer, got {value}")


ZERO_GRAD = ("auto", "none", "zeros")
"""``zero_grad`` choices: the stack's default, gradients set to None, or zeroed and kept."""

TRICK_DEFAULTS = {
    "optimizer_in_backward": False,
    "activation_offload": False,
    "loss_chunks": 0,
    "fused_ce": False,
    "packing": False,
    "dora": False,
    "compile": False,
}


def _check_tricks(recipe: Recipe) -> None:
    """Validate the recipe tricks (optimizer in backward, offloading, chunked loss, DoRA)."""
    chunks = recipe.loss_chunks
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 0:
        raise UserError(f"--loss-chunks must be a non-negative integer, got {chunks}")
    if chunks and recipe.fused_ce:
        raise UserError("choose one of --loss-chunks and --fused-ce (both replace the loss)")
    training = {
        "--optimizer-in-backward": recipe.optimizer_in_backward,
        "--activation-offload": recipe.activation_offload,
        "--compile": recipe.compile,
    }
    for flag, on in training.items():
        if on and not recipe.is_training:
            raise UserError(f"{flag} acts on backward; --mode infer has none")
    if recipe.optimizer_in_backward:
        if recipe.grad_accum > 1:
            raise UserError(
                "--optimizer-in-backward steps each parameter as its gradient arrives, so "
                "gradients cannot accumulate: use --grad-accum 1"
            )
        if recipe.optimizer == "none":
            raise UserError("--optimizer-in-backward needs an optimizer")
    if recipe.compile and recipe.uses_autocast:
        raise UserError(
            "--compile under autocast (--precision amp-*) is not modelled: the traced graph "
            "would miss autocast's casts; use a pure precision (fp32, bf16, fp16)"
        )
    if recipe.dora and not recipe.lora_rank:
        raise UserError("--dora needs --lora R (DoRA is peft's LoRA with use_dora=True)")
    if recipe.dora and recipe.quantize != "none":
        raise UserError(
            "--dora over --quantize is not modelled (peft dequantizes bitsandbytes' "
            "own layers, which vramplan models without bitsandbytes)"
        )


# -- storage habits of frameworks (weights_dtype, keep_fp32, loss_shift_copy, additive_mask) -

STORAGE_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
STORAGE_DEFAULTS = {
    "weights_dtype": None,
    "keep_fp32": None,
    "loss_shift_copy": False,
    "loss_no_upcast": False,
    "additive_mask": False,
    "kv_in_training": False,
    "repeat_kv": False,
    "reentrant": False,
}


def _check_storage(recipe: Recipe) -> None:
    """Validate the storage knobs: ``weights_dtype`` only under autocast (with pure
    precision the weights already are in it), ``keep_fp32`` as name patterns."""
    if recipe.weights_dtype is not None:
        object.__setattr__(
            recipe,
            "weights_dtype",
            _choice(recipe.weights_dtype, tuple(STORAGE_DTYPES), "weights dtype"),
        )
        if not recipe.uses_autocast:
            raise UserError(
                f"--weights-dtype {recipe.weights_dtype} stores weights in half precision "
                "under autocast: it needs --precision amp-bf16 or amp-fp16"
            )
    keep = recipe.keep_fp32
    if keep is not None and (not isinstance(keep, str) or not keep.strip(" ,")):
        raise UserError(f"--keep-fp32 needs comma-separated parameter-name patterns, got {keep!r}")
    if recipe.loss_shift_copy and (recipe.loss_chunks or recipe.fused_ce):
        raise UserError(
            "--loss-shift-copy is transformers' own loss; --loss-chunks and --fused-ce replace it"
        )
    if recipe.reentrant and recipe.checkpointing == "op":
        raise UserError(
            "--reentrant and --checkpointing op: reentrant torch.utils.checkpoint takes no "
            "op-level policy (context_fn needs use_reentrant=False)"
        )
    if recipe.loss_no_upcast and not recipe.loss_shift_copy:
        raise UserError(
            "--loss-no-upcast is a form of --loss-shift-copy (the shifted copy kept in the "
            "logits' dtype): give both"
        )
