"""Command-line options shared by every command that estimates a step.

>>> recipe_from_options(dict(batch_size=8, seq_len=None, input_shape="3x32x32",
...     precision="fp32", optimizer="sgd", checkpointing="none", grad_accum=1,
...     mode="train")).input_shape
(3, 32, 32)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import typer

import vramplan
from vramplan import Recipe

Model = Annotated[
    str,
    typer.Argument(
        help="torchvision:NAME, timm:NAME, hf:NAME (or hf:path/config.json), keras:NAME "
        "(or keras:file.keras, keras:file.py:factory), file.py:factory, package.module:factory",
        show_default=False,
    ),
]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", help="Samples per step (per GPU).")]
SeqLen = Annotated[
    int | None, typer.Option("--seq-len", "-s", help="Tokens per sample (text models).")
]
InputShape = Annotated[
    str | None,
    typer.Option(
        "--input-shape", help="One sample's shape without the batch, e.g. 3x224x224 or 512."
    ),
]
PrecisionOpt = Annotated[
    str,
    typer.Option(
        "--precision",
        "-p",
        help="fp32 | fp16 | bf16 | amp-fp16 | amp-bf16 (amp: fp32 weights + autocast).",
    ),
]
OptimizerOpt = Annotated[
    str,
    typer.Option(
        "--optimizer",
        "-o",
        help="sgd | momentum | adam | adamw | adagrad | rmsprop | adafactor | lion | adam8bit "
        "| paged_adamw_8bit | paged_adamw_32bit | none.",
    ),
]
OptimizerImplOpt = Annotated[
    str,
    typer.Option(
        "--optimizer-impl",
        help="auto | foreach | for-loop | fused: how torch.optim runs the step (auto: the "
        "emulated PyTorch's default, foreach on CUDA since 2.0).",
    ),
]
CheckpointingOpt = Annotated[
    str,
    typer.Option(
        "--checkpointing",
        help="none | full | N | every:N | op: recompute all repeated blocks in backward, the "
        "first N, every Nth (torchtitan's layer-level selective), or only what torchtitan's "
        "op-level selective policy does not save (matmuls, attention).",
    ),
]
GradAccum = Annotated[int, typer.Option("--grad-accum", help="Micro-batches per optimizer step.")]
ZeroGradOpt = Annotated[
    str,
    typer.Option(
        "--zero-grad",
        help="auto | none | zeros: what zero_grad() does between steps (auto: the emulated "
        "PyTorch's default, None since 2.0; zeros keeps every gradient through the forward).",
    ),
]
ModeOpt = Annotated[
    str,
    typer.Option(
        "--mode",
        help="train | infer (no_grad, no optimizer) | generate (transformers' generate: "
        "prefill, KV cache, decode; --prompt-len, --new-tokens).",
    ),
]
TargetOpt = Annotated[
    str,
    typer.Option(
        "--target", help="cuda (emulate an NVIDIA GPU, default) | cpu (what the CPU itself does)."
    ),
]
TrustRemoteCodeOpt = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="Let a Hugging Face model run the modeling code its repository ships (auto_map); "
        "off by default.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the vramplan.estimate/1 JSON object.")]
UnitsOpt = Annotated[str, typer.Option("--units", help="binary (MiB/GiB) | decimal (MB/GB).")]


RECIPE_OPTIONS = (
    "batch_size",
    "seq_len",
    "input_shape",
    "precision",
    "optimizer",
    "checkpointing",
    "grad_accum",
    "mode",
)


def recipe_from_options(options: dict) -> Recipe:
    """Validate a command's recipe options (read by name from ``options``, e.g. the
    command's ``locals()``) into a Recipe; a UserError on any bad value."""
    knobs = {name: options[name] for name in RECIPE_OPTIONS}
    if "optimizer_impl" in options:
        knobs["optimizer_impl"] = options["optimizer_impl"]
    if "zero_grad" in options:
        knobs["zero_grad"] = options["zero_grad"]
    model_inputs = {name: options[name] for name in MODEL_INPUT_OPTIONS if name in options}
    return Recipe(
        **knobs,
        **finetune_from_options(options),
        **generation_from_options(options),
        **vision_from_options(options),
        **model_inputs,
    )


def session_from_options(options: dict, **extra) -> vramplan.Session:
    """The Session a command's device options ask for (read by name from ``options``, e.g.
    the command's ``locals()``; those it does not have keep the Session's defaults)."""
    accepted = inspect.signature(vramplan.Session).parameters
    chosen = {
        name: options[name]
        for name in accepted
        if name != "model" and name in options and name not in extra
    }
    return vramplan.Session(options["model"], **chosen, **extra)


# TensorFlow's runtime and Keras files (device/tensorflow.py, sources/keras_models.py)
TfMemoryGrowthOpt = Annotated[
    bool,
    typer.Option(
        "--tf-memory-growth",
        help="TensorFlow: tf.config.experimental.set_memory_growth (take only what the "
        "step needs instead of preallocating the card).",
    ),
]
TfMemoryLimitOpt = Annotated[
    str | None,
    typer.Option(
        "--tf-memory-limit", help="TensorFlow: a logical device's memory_limit, e.g. 8GiB."
    ),
]
AllowCustomObjectsOpt = Annotated[
    bool,
    typer.Option(
        "--allow-custom-objects",
        help="keras:file.keras: import the modules its custom classes name (runs their code).",
    ),
]

GpuOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        "-g",
        help="Judge against a catalog card: a100, A100-80GB, h100, t4, ... (see `vramplan gpus`).",
    ),
]
GpuMemoryOpt = Annotated[
    str | None,
    typer.Option("--gpu-memory", help="Judge against a card of this size instead, e.g. 24GiB."),
]
HeadroomOpt = Annotated[
    float,
    typer.Option("--headroom", help="Fraction of the card kept free for safety (0.10 = 10%)."),
]
AllocConfOpt = Annotated[
    str | None,
    typer.Option(
        "--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF to emulate, e.g. expandable_segments:True."
    ),
]
CudnnBenchmarkOpt = Annotated[
    bool, typer.Option("--cudnn-benchmark", help="Emulate torch.backends.cudnn.benchmark=True.")
]
StackOpt = Annotated[
    str | None,
    typer.Option(
        "--stack",
        help="The PyTorch + CUDA stack to emulate, like torch2.14-cu12.8 (default: the "
        "installed torch). Sets lazy vs eager module loading and picks measured tables.",
    ),
]
UsedCounterOpt = Annotated[
    str,
    typer.Option(
        "--used-counter",
        help="Which 'used' the device total matches: nvml-v1 (pynvml's default, nvidia-smi "
        "before R510: counts the driver-reserved framebuffer) or nvml-v2 (does not).",
    ),
]
FrameworkOpt = Annotated[
    str,
    typer.Option(
        "--framework",
        help="pytorch | tensorflow (TensorFlow: its memory limit, preallocation and BFC "
        "allocator replayed over the step).",
    ),
]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile", help="A device profile from `vramplan calibrate` (measured runtime figures)."
    ),
]
HtmlOpt = Annotated[
    str | None, typer.Option("--html", help="Also write a self-contained HTML report to this path.")
]
PlotOpt = Annotated[
    str | None,
    typer.Option(
        "--plot", help="Also write a PNG of the breakdown and timeline (needs matplotlib)."
    ),
]
FsdpOpt = Annotated[
    int | None,
    typer.Option("--fsdp", help="FSDP full sharding over N data-parallel GPUs (per-rank figures)."),
]
WorldSizeOpt = Annotated[
    int | None, typer.Option("--world-size", help="Data-parallel GPUs, with --shard.")
]
ShardOpt = Annotated[
    str, typer.Option("--shard", help="full | grad-op | none (with --world-size).")
]
FsdpVersionOpt = Annotated[
    int,
    typer.Option(
        "--fsdp-version",
        help="2: FSDP2 (fully_shard); 1: FSDP1 (FullyShardedDataParallel, accelerate's "
        "default), traced as FSDP2 plus what FSDP1 holds under --reentrant checkpointing.",
    ),
]
ReshardOpt = Annotated[
    bool,
    typer.Option(
        "--reshard-after-forward/--no-reshard-after-forward",
        help="FSDP: free gathered parameters after forward (default) or keep them to backward.",
    ),
]
ZeroOpt = Annotated[int | None, typer.Option("--zero", help="DeepSpeed ZeRO stage 1, 2 or 3.")]
DpOpt = Annotated[int | None, typer.Option("--dp", help="Data-parallel GPUs for --zero.")]
OffloadOptimizerOpt = Annotated[
    bool,
    typer.Option(
        "--offload-optimizer",
        help="ZeRO: optimizer state on the CPU (plan without --zero: counted in host RAM).",
    ),
]
OffloadParamsOpt = Annotated[
    bool, typer.Option("--offload-params", help="ZeRO-3: parameters on the CPU.")
]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel degree (Megatron).")]
SpOpt = Annotated[bool, typer.Option("--sp", help="Sequence parallelism with --tp.")]
PpOpt = Annotated[int, typer.Option("--pp", help="Pipeline-parallel stages (1F1B).")]
MicrobatchesOpt = Annotated[
    int,
    typer.Option(
        "--microbatches",
        help="Micro-batches per step with --pp (the batch size is per micro-batch).",
    ),
]
QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet", "-q", help="No progress line on stderr while tracing (--json implies it)."
    ),
]


# -- groups of options that several commands take, declared once -------------------------

Command = TypeVar("Command", bound=Callable[..., Any])


@dataclass(frozen=True)
class OptionGroup:
    """Command-line options several commands take, declared once: each option's name, typer
    annotation and default. ``@with_options(GROUP)`` adds them to a command.

    >>> group = OptionGroup.of(quiet=(QuietOpt, False))
    >>> group.names, group.parameters()[0].default
    (('quiet',), False)
    """

    options: tuple[tuple[str, Any, Any], ...]

    @classmethod
    def of(cls, **options: tuple[Any, Any]) -> OptionGroup:
        """A group from ``name=(annotation, default)`` pairs, in that order."""
        return cls(
            tuple((name, annotation, default) for name, (annotation, default) in options.items())
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.options)

    def parameters(self) -> list[inspect.Parameter]:
        kind = inspect.Parameter.KEYWORD_ONLY
        return [
            inspect.Parameter(name, kind, default=default, annotation=annotation)
            for name, annotation, default in self.options
        ]


def with_options(*groups: OptionGroup) -> Callable[[Command], Command]:
    """Add ``groups``' options to a typer command after its own; the command receives them
    in a ``**shared`` keyword parameter (typer reads the signature this sets)::

        @app.command("plan")
        @with_options(*FINETUNING)
        def plan_command(ctx: typer.Context, ..., **shared) -> int:
            options = {**locals(), **shared}
    """

    def decorate(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        added = [parameter for group in groups for parameter in group.parameters()]
        clash = {p.name for p in own} & {p.name for p in added}
        if clash:
            raise TypeError(f"{command.__name__} declares shared options itself: {sorted(clash)}")

        @functools.wraps(command)
        def run(**options: Any) -> Any:
            return command(**options)

        run.__signature__ = signature.replace(parameters=[*own, *added])
        return run  # type: ignore[return-value]

    return decorate


# -- fine-tuning (sources/finetune.py) -----------------------------------------------------

LoraOpt = Annotated[
    int,
    typer.Option(
        "--lora",
        help="LoRA rank R: wrap the model with peft's get_peft_model(LoraConfig(r=R)); base "
        "weights frozen (0: no LoRA).",
    ),
]
LoraTargetsOpt = Annotated[
    str | None,
    typer.Option(
        "--lora-targets",
        help="Comma-separated module names (q_proj,v_proj) or all-linear (default: peft's "
        "per-architecture choice).",
    ),
]
LoraAlphaOpt = Annotated[
    float | None, typer.Option("--lora-alpha", help="LoRA alpha (default: peft's, 8).")
]
LoraDropoutOpt = Annotated[
    float, typer.Option("--lora-dropout", help="Dropout on the adapters' input (keeps a mask).")
]
FreezeOpt = Annotated[
    str | None,
    typer.Option(
        "--freeze",
        help="Comma-separated fnmatch patterns of parameter names to freeze, e.g. 'model.embed*'.",
    ),
]
TrainOnlyOpt = Annotated[
    str | None,
    typer.Option(
        "--train-only",
        help="Comma-separated fnmatch patterns: only matching parameters train, e.g. "
        "'classifier.*'.",
    ),
]
QuantizeOpt = Annotated[
    str,
    typer.Option(
        "--quantize",
        help="none | nf4 | fp4 | int8: bitsandbytes' storage of every linear but the output "
        "head (QLoRA: --quantize nf4 --lora R); gptq | awq: an int4 checkpoint as GPT-QModel "
        "stores and runs it; fp8: transformers' fine-grained FP8 (--mode infer|generate).",
    ),
]
DoubleQuantOpt = Annotated[
    bool,
    typer.Option(
        "--double-quant", help="4-bit: quantize the absmax too (bnb_4bit_use_double_quant)."
    ),
]
ComputeDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--compute-dtype",
        help="bf16 | fp16 | fp32: dtype the quantized layers dequantize to (default: the "
        "precision's half dtype, else bf16; transformers' BitsAndBytesConfig default is fp32).",
    ),
]
BnbVersionOpt = Annotated[
    str | None,
    typer.Option(
        "--bnb-version",
        help="4-bit: the bitsandbytes release emulated (default 0.50; before it, weights "
        "dequantize in their own dtype and are then cast to the compute dtype).",
    ),
]

# int4 checkpoints (--quantize gptq|awq, sources/int4.py)
GroupSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--group-size", help="gptq/awq: inputs per scale and zero (default 128; -1: one)."
    ),
]
QuantKernelOpt = Annotated[
    str | None,
    typer.Option(
        "--quant-kernel",
        help="gptq/awq: the kernel that runs them: marlin (default), exllamav2 (gptq), gemm (awq).",
    ),
]
ActOrderOpt = Annotated[
    bool, typer.Option("--act-order", help="gptq: act-order (desc_act) checkpoint, g_idx kept.")
]

FINETUNE_OPTIONS = OptionGroup.of(
    lora=(LoraOpt, 0),
    lora_targets=(LoraTargetsOpt, None),
    lora_alpha=(LoraAlphaOpt, None),
    lora_dropout=(LoraDropoutOpt, 0.0),
    freeze=(FreezeOpt, None),
    train_only=(TrainOnlyOpt, None),
    quantize=(QuantizeOpt, "none"),
    double_quant=(DoubleQuantOpt, False),
    compute_dtype=(ComputeDtypeOpt, None),
    bnb_version=(BnbVersionOpt, None),
    group_size=(GroupSizeOpt, None),
    quant_kernel=(QuantKernelOpt, None),
    act_order=(ActOrderOpt, False),
)


def finetune_from_options(options: dict) -> dict:
    """The fine-tuning knobs among a command's options (those it has), by Recipe name."""
    names = FINETUNE_OPTIONS.names + TRICK_OPTIONS.names + STORAGE_OPTIONS.names
    knobs = {name: options[name] for name in names if name in options}
    if "lora" in knobs:
        knobs["lora_rank"] = knobs.pop("lora")
    return knobs


# -- recipe tricks (trace/tricks.py, sources/loss.py) ----------------------------------------

OptimizerInBackwardOpt = Annotated[
    bool,
    typer.Option(
        "--optimizer-in-backward",
        help="Step each parameter in its gradient hook and free its gradient at once "
        "(torchtune's optimizer_in_bwd); needs --grad-accum 1.",
    ),
]
ActivationOffloadOpt = Annotated[
    bool,
    typer.Option(
        "--activation-offload",
        "--offload-activations",
        help="Saved activations go to host memory in forward and come back in backward "
        "(torchtune's OffloadActivations); host RAM reported.",
    ),
]
LossChunksOpt = Annotated[
    int,
    typer.Option(
        "--loss-chunks",
        "--chunked-loss",
        help="Causal LMs: output head + cross-entropy over N sequence chunks "
        "(torchtune's CEWithChunkedOutputLoss; 0: the model's own loss).",
    ),
]
FusedCeOpt = Annotated[
    bool,
    typer.Option(
        "--fused-ce",
        help="Causal LMs: Liger's fused linear cross-entropy (logits never whole, "
        "gradients made in forward).",
    ),
]
PackingOpt = Annotated[
    bool,
    typer.Option(
        "--packing", help="Packed sequences: batch x seq-len real tokens per step, no padding."
    ),
]
DoraOpt = Annotated[
    bool, typer.Option("--dora", help="DoRA: peft's LoraConfig(use_dora=True), with --lora R.")
]

CompileOpt = Annotated[
    bool,
    typer.Option(
        "--compile",
        help="torch.compile each repeated block and the chunked loss (torchtune's "
        "compile=True): what AOTAutograd's min-cut partitioner saves for backward.",
    ),
]

TRICK_OPTIONS = OptionGroup.of(
    optimizer_in_backward=(OptimizerInBackwardOpt, False),
    activation_offload=(ActivationOffloadOpt, False),
    loss_chunks=(LossChunksOpt, 0),
    fused_ce=(FusedCeOpt, False),
    packing=(PackingOpt, False),
    dora=(DoraOpt, False),
    compile=(CompileOpt, False),
)

# -- how a framework stores the model (trace/storage.py, sources/loss.py) -------------------

WeightsDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--weights-dtype",
        help="With --precision amp-bf16/amp-fp16: weights stored in bf16 or fp16 "
        "(a model loaded with torch_dtype=bfloat16, trained with bf16=True).",
    ),
]
KeepFp32Opt = Annotated[
    str | None,
    typer.Option(
        "--keep-fp32",
        help="Parameter-name patterns kept in fp32 in a half-precision model "
        "(peft's adapters: '*lora_*'; TRL's QLoRA norms: '*norm*').",
    ),
]
LossShiftCopyOpt = Annotated[
    bool,
    typer.Option(
        "--loss-shift-copy",
        help="Causal LMs: transformers < 4.49's loss (an fp32 copy of the shifted logits).",
    ),
]
LossNoUpcastOpt = Annotated[
    bool,
    typer.Option(
        "--loss-no-upcast",
        help="With --loss-shift-copy: the shifted copy in the logits' dtype, no fp32 upcast "
        "(the own loss gpt_bigcode and GPT-2 kept through transformers 4.48).",
    ),
]
AdditiveMaskOpt = Annotated[
    bool,
    typer.Option(
        "--additive-mask",
        help="Hugging Face encoders: transformers 4.x's attention mask (4.15 checked), built "
        "even for a batch without one and added to the scores in the weights' dtype.",
    ),
]
KvInTrainingOpt = Annotated[
    bool,
    typer.Option(
        "--kv-in-training",
        help="gpt_bigcode: transformers 4.x's model returns its key/value cache in training "
        "too (use_cache stays on under gradient checkpointing), so each block's fused "
        "query/key/value projection lives until the loss.",
    ),
]
RepeatKvOpt = Annotated[
    bool,
    typer.Option(
        "--repeat-kv",
        help="Grouped-query attention: K and V repeated to every query head before SDPA, "
        "as transformers before 4.54 and torchtune's MultiHeadAttention do (the copies SDPA "
        "keeps for backward); transformers 5 passes enable_gqa instead.",
    ),
]
ReentrantOpt = Annotated[
    bool,
    typer.Option(
        "--reentrant",
        help="With --checkpointing: blocks recompute through reentrant torch.utils.checkpoint "
        "(transformers 4.x's gradient_checkpointing without gradient_checkpointing_kwargs); "
        "the same bytes, except what --fsdp-version 1 holds.",
    ),
]
STORAGE_OPTIONS = OptionGroup.of(
    weights_dtype=(WeightsDtypeOpt, None),
    keep_fp32=(KeepFp32Opt, None),
    loss_shift_copy=(LossShiftCopyOpt, False),
    loss_no_upcast=(LossNoUpcastOpt, False),
    additive_mask=(AdditiveMaskOpt, False),
    kv_in_training=(KvInTrainingOpt, False),
    repeat_kv=(RepeatKvOpt, False),
    reentrant=(ReentrantOpt, False),
)
FINETUNING = (FINETUNE_OPTIONS, TRICK_OPTIONS, STORAGE_OPTIONS)
"""What every command that traces a fine-tuning step takes: ``@with_options(*FINETUNING)``."""


TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout",
        help="Seconds each call into your code (a factory, a traced step) may take.",
    ),
]


# -- generation (--mode generate, trace/generate.py) ----------------------------------------

PromptLenOpt = Annotated[
    int | None,
    typer.Option(
        "--prompt-len", help="--mode generate: prompt tokens per sequence (default --seq-len, 512)."
    ),
]
NewTokensOpt = Annotated[
    int | None,
    typer.Option("--new-tokens", help="--mode generate: tokens generated (max_new_tokens, 256)."),
]
CacheOpt = Annotated[
    str,
    typer.Option(
        "--cache",
        help="--mode generate: dynamic (DynamicCache, grown by torch.cat) | static "
        "(StaticCache sized to prompt + new tokens) | quanto | hqq | fp8 (QuantizedCache).",
    ),
]
NumBeamsOpt = Annotated[
    int, typer.Option("--num-beams", help="--mode generate: beams per prompt (beam search).")
]
KvBitsOpt = Annotated[
    int | None, typer.Option("--kv-bits", help="--cache quanto|hqq: bits per value (default 4).")
]
KvGroupSizeOpt = Annotated[
    int | None,
    typer.Option("--kv-group-size", help="--cache quanto|hqq: values per scale (default 64)."),
]
KvResidualOpt = Annotated[
    int | None,
    typer.Option(
        "--kv-residual-length",
        help="--cache quanto|hqq: tokens kept in full precision (default 128).",
    ),
]
GENERATION_OPTIONS = (
    "prompt_len",
    "new_tokens",
    "cache",
    "num_beams",
    "kv_bits",
    "kv_group_size",
    "kv_residual_length",
)


def generation_from_options(options: dict) -> dict:
    """The generation knobs among a command's options (those it has)."""
    return {name: options[name] for name in GENERATION_OPTIONS if name in options}


# -- vision tasks (sources/detection.py, sources/diffusion.py) -----------------------------

BoxesPerImageOpt = Annotated[
    int,
    typer.Option(
        "--boxes-per-image",
        help="Detection: ground-truth boxes (with masks/keypoints) per image in the batch "
        "(0: images without objects).",
    ),
]
BusiestImageBoxesOpt = Annotated[
    int | None,
    typer.Option(
        "--busiest-image-boxes",
        help="Detection: the last image of the batch holds this many boxes, the others "
        "--boxes-per-image: the busiest image of a run, where its peak is (COCO train2017: 93).",
    ),
]
DetectionCountsOpt = Annotated[
    str,
    typer.Option(
        "--detection-counts",
        help="Detection: max (data-dependent counts at the configured maxima: NMS keeps "
        "everything, samplers reach their caps) | min (each ground-truth box matched once).",
    ),
]
TargetsOnGpuOpt = Annotated[
    str,
    typer.Option(
        "--targets-on-gpu",
        help="Detection: model (the targets the model reads: boxes, labels, and masks or "
        "keypoints for the models with those heads) | masks (a mask per box in every "
        "target, as torchvision's reference scripts load COCO for every model).",
    ),
]

BackboneNormOpt = Annotated[
    str,
    typer.Option(
        "--backbone-norm",
        help="Detection: frozen (FrozenBatchNorm2d, as torchvision and detectron2 train an "
        "ImageNet backbone) | eval (nn.BatchNorm2d held in eval mode, mmdetection's "
        "norm_eval=True: each keeps its input for backward).",
    ),
]

FocalLossOpt = Annotated[
    str,
    typer.Option(
        "--focal-loss",
        help="Detection (RetinaNet): ops (torchvision's sigmoid_focal_loss, op by op: several "
        "logits-sized tensors kept for backward) | fused (one kernel, as mmcv's in "
        "mmdetection: the logits kept).",
    ),
]

ResolutionOpt = Annotated[
    int | None,
    typer.Option(
        "--resolution",
        help="Diffusion: image side in pixels (latents are 1/8 of it; default: the model's).",
    ),
]

FramesOpt = Annotated[
    int | None,
    typer.Option("--frames", help="Video: frames per clip (input 3 x T x H x W; default 16)."),
]

DiffusionEncodersOpt = Annotated[
    str,
    typer.Option(
        "--diffusion-encoders",
        help="Diffusion: precomputed (VAE latents and text states computed beforehand) | "
        "frozen (the frozen VAE and text encoder run in every step, in the weight dtype, "
        "as diffusers' train_text_to_image.py does).",
    ),
]

VISION_OPTIONS = (
    "boxes_per_image",
    "busiest_image_boxes",
    "detection_counts",
    "targets_on_gpu",
    "backbone_norm",
    "focal_loss",
    "resolution",
    "frames",
    "diffusion_encoders",
)


def vision_from_options(options: dict) -> dict:
    """The vision-task knobs among a command's options (those it has), by Recipe name."""
    return {name: options[name] for name in VISION_OPTIONS if name in options}


# -- how a named model is built and fed (sources/) ------------------------------------------

AttentionOpt = Annotated[
    str | None,
    typer.Option(
        "--attention",
        help="eager | sdpa | flash_attention_2 | flex_attention: transformers' "
        "attn_implementation (default: the config's, else sdpa).",
    ),
]
MoeRoutingOpt = Annotated[
    str,
    typer.Option(
        "--moe-routing",
        help="balanced | worst: how tokens spread over a mixture-of-experts layer's experts "
        "(balanced: evenly; worst: every token to the same top-k experts).",
    ),
]
ExpertsOpt = Annotated[
    str | None,
    typer.Option(
        "--experts",
        help="grouped_mm | eager | linear: transformers' experts_implementation for "
        "mixture-of-experts models (default grouped_mm; eager is the per-expert loop "
        "--moe-routing sizes; linear is transformers 4.x's Mixtral layout, every expert three "
        "nn.Linear that --quantize reaches, run by that loop).",
    ),
]
TargetLenOpt = Annotated[
    int | None,
    typer.Option(
        "--target-len", help="Decoder tokens per sample of an encoder-decoder model (T5, Whisper)."
    ),
]
NumClassesOpt = Annotated[
    int | None,
    typer.Option("--num-classes", help="Classes of an image model's head (default: the model's)."),
]

MODEL_INPUT_OPTIONS = ("attention", "moe_routing", "experts", "target_len", "num_classes")
# -- the parallel layout (distributed/options.py) --------------------------------------------

LAYOUT = OptionGroup.of(
    fsdp=(FsdpOpt, None),
    world_size=(WorldSizeOpt, None),
    shard=(ShardOpt, "full"),
    reshard_after_forward=(ReshardOpt, True),
    fsdp_version=(FsdpVersionOpt, 2),
    zero=(ZeroOpt, None),
    dp=(DpOpt, None),
    offload_optimizer=(OffloadOptimizerOpt, False),
    offload_params=(OffloadParamsOpt, False),
    tp=(TpOpt, 1),
    sp=(SpOpt, False),
    pp=(PpOpt, 1),
    microbatches=(MicrobatchesOpt, 1),
)
"""The parallel layout a command judges one rank of: ``@with_options(..., LAYOUT)``."""


def layout_from_options(options: dict) -> vramplan.ParallelLayout:
    """The ParallelLayout a command's layout options ask for (read by name from ``options``)."""
    return vramplan.parallel_layout(**{name: options[name] for name in LAYOUT.names})
