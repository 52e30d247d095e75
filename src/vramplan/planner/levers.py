"""The levers that cut a step's memory, ranked, and the first plan that fits.

Levers come in the standard order of the literature: mixed precision, activation
checkpointing, a lighter optimizer, gradient accumulation (keeping the effective batch).
Every lever's figure is traced, not guessed; its cost is measured where it can be (extra
FLOPs of recomputation, counted by PyTorch's FlopCounterMode on the fake step)::

    result = plan_levers(bench, Recipe(batch_size=64))
    result.plan.flags   # e.g. '--precision amp-bf16 --checkpointing 6'
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramplan.pipeline import trace_and_estimate
from vramplan.planner.bench import Workbench
from vramplan.recipe import FUSED_OPTIMIZERS, Recipe
from vramplan.result import Estimate
from vramplan.trace.events import FLOPS_KEY
from vramplan.trace.policy import CudaPolicy

ADAM_FAMILY = ("adam", "adamw")
FLAG_NAMES = {
    "precision": "--precision",
    "checkpointing": "--checkpointing",
    "optimizer": "--optimizer",
    "optimizer_impl": "--optimizer-impl",
    "batch_size": "--batch-size",
    "grad_accum": "--grad-accum",
    "lora_rank": "--lora",
    "lora_targets": "--lora-targets",
    "quantize": "--quantize",
    "double_quant": "--double-quant",
    "optimizer_in_backward": "--optimizer-in-backward",
    "activation_offload": "--activation-offload",
    "loss_chunks": "--loss-chunks",
}
# Fine-tuning levers (HF decoders only): LoRA r=16 on every linear, and QLoRA (the same
# adapters over an NF4, double-quantized base), as the QLoRA paper and peft recipes run them.
LORA = {"lora_rank": 16, "lora_targets": "all-linear"}
QLORA = {"quantize": "nf4", "double_quant": True, **LORA}
FINETUNE_LEVERS = ("LoRA", "QLoRA")
# Shown alone in the table; the first plan combines only the standard levers (each trick
# would multiply the traces the search runs).
TRICK_LEVERS = (
    "paged 8-bit AdamW",
    "optimizer step in backward",
    "activation offloading",
    "chunked loss",
)


@dataclass(frozen=True)
class LeverResult:
    """One lever (or a combination) applied to the baseline recipe."""

    name: str
    changes: dict
    estimate: Estimate
    saved_bytes: int
    """The drop in the device total (what nvidia-smi would show)."""
    cost: dict
    saved_allocated_bytes: int = 0
    """The drop in the allocated peak (``max_memory_allocated``): tensors can shrink while
    the allocator's segments and the runtime keep the device total where it was."""

    @property
    def status(self) -> str:
        return self.estimate.verdict.status

    @property
    def flags(self) -> str:
        return " ".join(
            FLAG_NAMES[k] if v is True else f"{FLAG_NAMES[k]} {v}" for k, v in self.changes.items()
        )

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "changes": self.changes,
            "flags": self.flags,
            "status": self.status,
            "saved_bytes": self.saved_bytes,
            "saved_allocated_bytes": self.saved_allocated_bytes,
            "cost": self.cost,
            "peak": self.estimate.peak.to_json(),
        }


@dataclass(frozen=True)
class PlanResult:
    """The baseline, every lever alone, and the first combination that fits."""

    baseline: Estimate
    levers: tuple[LeverResult, ...]
    plan: LeverResult | None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        return {
            "schema": "vramplan.plan/1",
            "estimate": self.baseline.to_json(timeline=False),
            "levers": [lever.to_json() for lever in self.levers],
            "plan": self.plan.to_json() if self.plan else None,
            "notes": list(self.notes),
        }


class _CountingPolicy(CudaPolicy):
    """The CUDA policy plus a FLOP counter over the whole traced run."""

    def __init__(self, arch: str) -> None:
        # Imported here: torch.utils.flop_counter loads triton (about 80 MiB resident and
        # 0.15 s), which only plan's recompute cost needs, not every estimate.
        from torch.utils.flop_counter import FlopCounterMode

        super().__init__(arch)
        self.counter = FlopCounterMode(display=False)

    def dispatch_modes(self, recipe: Recipe) -> list:
        return [*super().dispatch_modes(recipe), self.counter]


def step_flops(bench: Workbench, recipe: Recipe) -> int:
    """FLOPs of the traced run (two iterations) under ``recipe``."""
    policy = _CountingPolicy(bench.device.card.arch)
    _, trace = bench.timed(
        recipe,
        lambda: trace_and_estimate(bench.built(recipe), recipe, "cuda", bench.device, policy),
        "FLOPs",
    )
    return trace.op_counts[FLOPS_KEY]  # the whole depth's, where blocks were repeated


def _mixed_precision(bench: Workbench) -> str:
    return "amp-bf16" if bench.device.card.supports_bf16 else "amp-fp16"


def _candidates(bench: Workbench, recipe: Recipe) -> list[tuple[str, dict, dict]]:
    """(name, recipe changes, cost) of each lever that applies, in the standard order."""
    found = []
    if recipe.precision == "fp32":
        amp = _mixed_precision(bench)
        risk = (
            "bf16: no loss scaling needed"
            if amp == "amp-bf16"
            else "fp16: needs loss scaling (GradScaler); overflow risk"
        )
        found.append(("mixed precision", {"precision": amp}, {"precision_risk": risk}))
        if amp == "amp-bf16":
            found.append(
                (
                    "bf16 weights",
                    {"precision": "bf16"},
                    {
                        "precision_risk": "weights, gradients and optimizer state in bf16: small "
                        "updates can round away (Kahan summation or stochastic "
                        "rounding help)"
                    },
                )
            )
    if recipe.checkpointing == "none" and recipe.is_training:
        found.append(("activation checkpointing", {"checkpointing": "full"}, {}))
    fusable = recipe.optimizer in FUSED_OPTIMIZERS and recipe.optimizer_impl != "fused"
    if recipe.is_training and fusable:
        found.append(
            (
                "fused optimizer",
                {"optimizer_impl": "fused"},
                {"note": "the same updates in fused kernels: no foreach temporaries"},
            )
        )
    if recipe.optimizer in ADAM_FAMILY:
        found.append(
            (
                "8-bit Adam",
                {"optimizer": "adam8bit"},
                {"note": "bitsandbytes blockwise 8-bit states; Adam-quality updates"},
            )
        )
        found.append(
            (
                "Adafactor",
                {"optimizer": "adafactor"},
                {"note": "factored second moment, no first moment"},
            )
        )
    elif recipe.optimizer == "momentum":
        found.append(
            (
                "SGD without momentum",
                {"optimizer": "sgd"},
                {"note": "drops the momentum buffer; changes the optimisation"},
            )
        )
    return found + _trick_candidates(bench, recipe) + _finetune_candidates(bench, recipe)


def _trick_candidates(bench: Workbench, recipe: Recipe) -> list[tuple[str, dict, dict]]:
    """torchtune's memory savers that keep full training: a paged 8-bit optimizer, the
    optimizer step in backward, activation offloading, and (causal LMs) a chunked loss, which
    replaces the model's own loss (so not beside ``--loss-shift-copy``, which describes it)."""
    if not recipe.is_training:
        return []
    found = []
    if recipe.optimizer in ADAM_FAMILY:
        found.append(
            (
                "paged 8-bit AdamW",
                {"optimizer": "paged_adamw_8bit"},
                {
                    "note": "bitsandbytes PagedAdamW8bit: large states in managed memory, paged "
                    "to the host under pressure"
                },
            )
        )
    if recipe.grad_accum == 1 and not recipe.optimizer_in_backward and recipe.optimizer != "none":
        found.append(
            (
                "optimizer step in backward",
                {"optimizer_in_backward": True},
                {
                    "note": "one optimizer per parameter: no gradient accumulation, no clipping "
                    "by the global norm"
                },
            )
        )
    if not recipe.activation_offload:
        found.append(
            (
                "activation offloading",
                {"activation_offload": True},
                {
                    "note": "saved tensors copied to pinned host memory and back every step "
                    "(PCIe traffic; overlapped on a side stream)"
                },
            )
        )
    if (
        bench.model.startswith("hf:")
        and not (recipe.loss_chunks or recipe.fused_ce or recipe.loss_shift_copy)
        and bench.estimate(recipe).model.kind == "causal-lm"
    ):
        found.append(
            (
                "chunked loss",
                {"loss_chunks": 8},
                {"note": "torchtune's chunked output head + cross-entropy: no whole fp32 logits"},
            )
        )
    return found


def _finetune_candidates(bench: Workbench, recipe: Recipe) -> list[tuple[str, dict, dict]]:
    """LoRA and QLoRA, for a Hugging Face decoder being fully fine-tuned that does not fit:
    they change what is trained (adapters only), so they come after the full-training
    levers."""
    if not (recipe.is_training and bench.model.startswith("hf:")):
        return []
    if recipe.lora_rank or recipe.quantize != "none" or recipe.freeze or recipe.train_only:
        return []
    baseline = bench.estimate(recipe)
    if baseline.model.kind != "causal-lm" or baseline.verdict.status == "fits":
        return []
    return [
        (
            "LoRA",
            dict(LORA),
            {"note": "peft adapters (r=16, all linear layers) train; the base is frozen"},
        ),
        (
            "QLoRA",
            dict(QLORA),
            {
                "note": "LoRA over an NF4 double-quantized base (bitsandbytes): each matmul "
                "dequantizes its weight, slower steps"
            },
        ),
    ]


def _apply(recipe: Recipe, changes: dict) -> Recipe:
    return recipe.with_changes(**changes)


def _accumulate(bench: Workbench, recipe: Recipe, changes: dict) -> dict | None:
    """The fewest micro-batches k (k divides the batch) that make ``changes`` fit while
    keeping the effective batch (none with the optimizer step in backward, which cannot
    accumulate)."""
    if changes.get("optimizer_in_backward") or recipe.optimizer_in_backward:
        return None
    batch = recipe.batch_size * recipe.grad_accum
    for k in range(2, recipe.batch_size + 1):
        if recipe.batch_size % k:
            continue
        trial = {
            **changes,
            "batch_size": recipe.batch_size // k,
            "grad_accum": recipe.grad_accum * k,
        }
        if bench.fits(_apply(recipe, trial)):
            assert trial["batch_size"] * trial["grad_accum"] == batch
            return trial
    return None


def _selective(bench: Workbench, recipe: Recipe, changes: dict) -> dict:
    """With checkpointing in ``changes``: the fewest leading blocks to recompute."""
    if changes.get("checkpointing") != "full":
        return changes
    built = bench.built(recipe)  # one meta build tells the block count
    if built.enable_checkpointing is None or not built.blocks:
        return changes
    total = built.blocks
    low, high = 0, total  # high fits (full); find the smallest count that fits
    while high - low > 1:
        middle = (low + high) // 2
        if bench.fits(_apply(recipe, {**changes, "checkpointing": str(middle)})):
            high = middle
        else:
            low = middle
    return {**changes, "checkpointing": "full" if high == total else str(high)}


def _result(
    bench: Workbench,
    recipe: Recipe,
    name: str,
    changes: dict,
    cost: dict,
    baseline: Estimate,
    base_flops: int | None,
) -> LeverResult:
    estimate = bench.estimate(_apply(recipe, changes))
    cost = dict(cost)
    if changes.get("checkpointing", "none") != "none" and base_flops:
        flops = step_flops(bench, _apply(recipe, changes))
        cost["recompute_fraction"] = round(flops / base_flops - 1.0, 4)
    if "grad_accum" in changes:
        cost["micro_steps_per_optimizer_step"] = changes["grad_accum"]
    if "lora_rank" in changes:
        cost["trainable_parameters"] = estimate.model.trainable_parameters
    host = estimate.details.get("host_bytes")
    if host:
        cost["host_bytes"] = sum(host.values())
    saved = baseline.peak.device_total_bytes - estimate.peak.device_total_bytes
    tensors = baseline.peak.allocated_bytes - estimate.peak.allocated_bytes
    return LeverResult(name, changes, estimate, saved, cost, tensors)


def plan_levers(bench: Workbench, recipe: Recipe) -> PlanResult:
    """Every lever alone, ranked in the standard order, then the first plan that fits."""
    baseline = bench.estimate(recipe)
    base_flops = step_flops(bench, recipe) if recipe.is_training else None
    candidates = _candidates(bench, recipe)
    wants_blocks = any("checkpointing" in changes for _, changes, _ in candidates)
    if wants_blocks and not bench.built(recipe).blocks:  # nothing repeats: no blocks
        candidates = [c for c in candidates if "checkpointing" not in c[1]]
    levers = [
        _result(bench, recipe, name, changes, cost, baseline, base_flops)
        for name, changes, cost in candidates
    ]
    if recipe.is_training and recipe.batch_size > 1 and not recipe.optimizer_in_backward:
        accumulation = _accumulate(bench, recipe, {})
        if accumulation is None:
            halves = (
                {"batch_size": max(1, recipe.batch_size // 2), "grad_accum": recipe.grad_accum * 2}
                if recipe.batch_size % 2 == 0
                else None
            )
            accumulation = halves
        if accumulation is not None:
            levers.append(
                _result(
                    bench, recipe, "gradient accumulation", accumulation, {}, baseline, base_flops
                )
            )
    notes = [
        "sharding (ZeRO/FSDP) and CPU offload are not levers in this table: the GPUs-needed "
        "answer covers them (per-rank ZeRO layouts, FSDP2 traced)"
    ]
    if any(lever.name in TRICK_LEVERS for lever in levers):
        notes.append(
            "paged 8-bit AdamW, the optimizer step in backward, activation offloading and the "
            "chunked loss are traced alone; the first plan combines the standard levers only"
        )
    plan = (
        None
        if baseline.verdict.status == "fits"
        else _first_plan(bench, recipe, levers, baseline, base_flops)
    )
    if baseline.verdict.status != "fits" and plan is None:
        notes.append(
            "no combination of these levers fits this card at this batch: "
            "a larger card, or sharding across GPUs, is needed"
        )
    return PlanResult(baseline, tuple(levers), plan, tuple(notes))


def _first_plan(
    bench: Workbench,
    recipe: Recipe,
    levers: list[LeverResult],
    baseline: Estimate,
    base_flops: int | None,
) -> LeverResult | None:
    """The smallest set of levers, in the standard order, that fits: a single lever if one
    does, else growing prefixes (precision, + checkpointing, + optimizer) — with mixed
    precision first, then bf16 weights — each tried with gradient accumulation when it
    does not fit alone; checkpointing is then trimmed to the fewest blocks that still fit."""
    singles = [lever for lever in levers if lever.name != "Adafactor"]
    for lever in singles:
        if lever.status == "fits":
            changes = _selective(bench, recipe, lever.changes)
            return _result(bench, recipe, lever.name, changes, lever.cost, baseline, base_flops)
    precisions = [lever for lever in singles if "precision" in lever.changes] or [None]
    others = [
        lever
        for lever in singles
        if "precision" not in lever.changes
        and lever.name != "gradient accumulation"
        and lever.name not in FINETUNE_LEVERS
        and lever.name not in TRICK_LEVERS
    ]
    for precision in precisions:
        changes = dict(precision.changes) if precision else {}
        names = [precision.name] if precision else []
        for lever in [None, *others]:
            if lever is not None:
                changes, names = combined(changes, names, lever)
            if not changes:
                continue
            trial = (
                changes
                if bench.fits(_apply(recipe, changes))
                else (_accumulate(bench, recipe, changes) if recipe.batch_size > 1 else None)
            )
            if trial is not None:
                trial = _selective(bench, recipe, trial)
                label = names + (["gradient accumulation"] if "grad_accum" in trial else [])
                return _result(bench, recipe, " + ".join(label), trial, {}, baseline, base_flops)
    finetunes = [lever for lever in singles if lever.name in FINETUNE_LEVERS]
    return _finetune_plan(bench, recipe, finetunes, precisions, baseline, base_flops)


def combined(changes: dict, names: list[str], lever: LeverResult) -> tuple[dict, list[str]]:
    """``changes`` (named ``names``) with ``lever`` added. A lever that replaces the
    optimizer with one outside torch.optim (8-bit Adam) drops a fused implementation
    chosen for the old one, which the new optimizer does not have.

    >>> fused = LeverResult("fused optimizer", {"optimizer_impl": "fused"}, None, 0, {})
    >>> eight = LeverResult("8-bit Adam", {"optimizer": "adam8bit"}, None, 0, {})
    >>> combined(*combined({}, [], fused), eight)
    ({'optimizer': 'adam8bit'}, ['8-bit Adam'])
    """
    merged = {**changes, **lever.changes}
    optimizer = lever.changes.get("optimizer")
    unfusable = optimizer is not None and optimizer not in FUSED_OPTIMIZERS
    if unfusable and merged.pop("optimizer_impl", None) is not None:
        names = [name for name in names if name != "fused optimizer"]
    return merged, [*names, lever.name]


def _finetune_plan(
    bench: Workbench,
    recipe: Recipe,
    finetunes: list[LeverResult],
    precisions: list[LeverResult | None],
    baseline: Estimate,
    base_flops: int | None,
) -> LeverResult | None:
    """LoRA, then QLoRA, with each precision, then with checkpointing too (and gradient
    accumulation when needed): the first that fits, checkpointing trimmed."""
    ckpt = {"checkpointing": "full"} if recipe.checkpointing == "none" else {}
    for finetune in finetunes:
        for precision in precisions:
            base = {**(precision.changes if precision else {}), **finetune.changes}
            names = [*([precision.name] if precision else []), finetune.name]
            for extra, extra_names in (({}, []), (ckpt, ["activation checkpointing"])):
                if extra_names and not extra:
                    continue
                changes = {**base, **extra}
                trial = (
                    changes
                    if bench.fits(_apply(recipe, changes))
                    else (_accumulate(bench, recipe, changes) if recipe.batch_size > 1 else None)
                )
                if trial is not None:
                    trial = _selective(bench, recipe, trial)
                    accum = ["gradient accumulation"] if "grad_accum" in trial else []
                    label = " + ".join(names + extra_names + accum)
                    return _result(bench, recipe, label, trial, finetune.cost, baseline, base_flops)
    return None
