"""The levers that cut a step's memory, ranked, and the first plan that fits.

Levers come in the standard order of the literature: mixed precision, activation
checkpointing, a lighter optimizer, gradient accumulation (keeping the effective batch),
then torchtune's tricks and, for a language model being fine-tuned, LoRA and QLoRA.
Every lever's figure is traced, not guessed; its cost is measured where it can be (extra
FLOPs of recomputation, counted by PyTorch's FlopCounterMode on the fake step). The first
plan combines them and, among the combinations that fit, takes the one with the least
modelled step time (``throughput.py``)::

    result = plan_levers(bench, Recipe(batch_size=64))
    result.plan.flags   # e.g. '--precision amp-bf16 --checkpointing 6'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vramplan.device.replay import SETTLES
from vramplan.distributed.layout import ParallelLayout
from vramplan.planner.bench import Workbench
from vramplan.planner.further import further
from vramplan.planner.throughput import Throughput
from vramplan.recipe import FUSED_OPTIMIZERS, Recipe
from vramplan.result import Component, Estimate
from vramplan.units import format_bytes

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
FINETUNED_KINDS = ("causal-lm", "vision-language")
"""The model kinds ``plan`` offers LoRA and QLoRA for."""


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
    layout_flags: str = ""
    """A sharding lever's layout flags (``--fsdp 8``): it changes the layout, not the recipe
    (``further.py``)."""

    @property
    def status(self) -> str:
        return self.estimate.verdict.status

    @property
    def flags(self) -> str:
        recipe_flags = [
            FLAG_NAMES[k] if v is True else f"{FLAG_NAMES[k]} {v}" for k, v in self.changes.items()
        ]
        return " ".join([*recipe_flags, *([self.layout_flags] if self.layout_flags else [])])

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


def step_flops(bench: Workbench, recipe: Recipe) -> int:
    """FLOPs of the traced run (two iterations) under ``recipe`` (``Workbench.flops``)."""
    return bench.flops(recipe)


def _mixed_precision(bench: Workbench) -> str:
    return "amp-bf16" if bench.device.card.supports_bf16 else "amp-fp16"


def _candidates(bench: Workbench, recipe: Recipe) -> list[tuple[str, dict, dict]]:
    """(name, recipe changes, cost) of each full-training lever that applies, in the
    standard order (read off the recipe and the built model: nothing is traced for them;
    the fine-tuning levers, which need the step's verdict, follow them)."""
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
    return found + _trick_candidates(bench, recipe)


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
        and bench.model_of(recipe).kind == "causal-lm"
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
    """LoRA and QLoRA, for a Hugging Face decoder or vision-language model being fully
    fine-tuned that does not fit (all linear layers adapted, the vision tower's too, as
    TRL's vision-language recipes do): they change what is trained (adapters only), so
    they come after the full-training levers."""
    if not (recipe.is_training and bench.model.startswith("hf:")):
        return []
    if recipe.lora_rank or recipe.quantize != "none" or recipe.freeze or recipe.train_only:
        return []
    baseline = bench.estimate(recipe)
    if baseline.model.kind not in FINETUNED_KINDS or baseline.verdict.status == "fits":
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
    accumulate); the next trials are traced on the workers the current one leaves idle."""
    trials = _accumulation_trials(recipe, changes)
    recipes = [_apply(recipe, trial) for trial in trials]
    for i, trial in enumerate(trials):
        bench.prefetch([recipes[i]], ahead=recipes[i + 1 :])
        if bench.fits(recipes[i]):
            return trial
    return None


def _accumulation_trials(recipe: Recipe, changes: dict) -> list[dict]:
    """``changes`` split into k micro-batches of the same effective batch, k = 2, 3, ...
    dividing the batch (none with the optimizer step in backward, which cannot accumulate).

    >>> [t["batch_size"] for t in _accumulation_trials(Recipe(batch_size=8), {})]
    [4, 2, 1]
    """
    if changes.get("optimizer_in_backward") or recipe.optimizer_in_backward:
        return []
    return [
        {**changes, "batch_size": recipe.batch_size // k, "grad_accum": recipe.grad_accum * k}
        for k in range(2, recipe.batch_size + 1)
        if recipe.batch_size % k == 0
    ]


def _halves(recipe: Recipe) -> dict | None:
    """Two micro-batches of half the batch (None for an odd batch)."""
    if recipe.batch_size % 2:
        return None
    return {"batch_size": max(1, recipe.batch_size // 2), "grad_accum": recipe.grad_accum * 2}


def _first_trials(bench: Workbench, recipe: Recipe, baseline: Estimate) -> list[dict]:
    """The accumulation trials the table will trace first: the first two (two and three
    micro-batches, or four), or only two micro-batches, the table's row, where the weights
    or everything the step holds whatever its batch do not fit (``_accumulation_row``)."""
    if _micro_batches_may_fit(bench, recipe, baseline):
        return _accumulation_trials(recipe, {})[:2]
    halves = _halves(recipe)
    return [halves] if halves is not None and _accumulation_trials(recipe, {}) else []


def _accumulation_row(bench: Workbench, recipe: Recipe, baseline: Estimate) -> dict | None:
    """The table's gradient accumulation: the fewest micro-batches that fit, else two (the
    lever's own figure). Where the weights alone do not fit (``baseline``'s, the same at
    every micro-batch: they stay on the card), or the weights with their gradients and
    optimizer state (``_resident_overflows``), no micro-batch fits, so none is tried: the
    verdict's high end is at least the device total, itself at least those bytes."""
    found = None
    if _micro_batches_may_fit(bench, recipe, baseline):
        found = _accumulate(bench, recipe, {})
    return found if found is not None else _halves(recipe)


def _micro_batches_may_fit(bench: Workbench, recipe: Recipe, baseline: Estimate) -> bool:
    """Whether a smaller micro-batch of ``recipe`` (``baseline``, its estimate) may fit:
    not where its weights alone, or its weights, gradients and optimizer state, pass the
    usable line (the same at every micro-batch)."""
    return _weights_leave_room(baseline) and not _resident_overflows(bench, recipe)


def _selective(
    bench: Workbench, recipe: Recipe, changes: dict, ahead: tuple[Recipe, ...] = ()
) -> dict:
    """With checkpointing in ``changes``: the fewest leading blocks to recompute. Memory
    falls about linearly with the blocks recomputed, so the line through the bracket's ends
    [does not fit, fits] predicts the boundary, traced with its neighbour where traces run
    side by side. The first line runs from no block recomputed (``_plain_first``) to every
    block; its guess lands on the answer or next to it, on either side, so the second
    round guesses again; from the third on, a round that did not halve the bracket is
    followed by a bisection (as ``search.py`` does for the batch). The answer is the count
    that fits with one fewer that does not: the same as bisecting. Workers a round leaves
    idle trace ``ahead`` (what is asked for next)."""
    if changes.get("checkpointing") != "full":
        return changes
    total = _recomputable(bench, recipe)
    if not total:
        return changes
    _plain_first(bench, recipe, changes, ahead)
    points, usable = _line_ends(bench, recipe, changes, total)
    low, high, width, rounds = 0, total, total, 0  # high fits (full): the fewest that fits
    while high - low > 1:
        guessing = rounds < 2 or high - low <= width // 2  # the line's first two guesses
        width, rounds = high - low, rounds + 1
        counts = _round_counts(points, low, high, usable, bench.width, guessing)
        trials = _counted(recipe, changes, counts)
        bench.prefetch(trials, ahead=list(ahead))
        for n, trial in zip(counts, trials, strict=True):
            points[n] = bench.estimate(trial).verdict.compared_bytes
        fitting = [n for n, trial in zip(counts, trials, strict=True) if bench.fits(trial)]
        # memory falls as more blocks recompute: fits from the first count that fits on
        high = min(fitting, default=high)
        low = max((n for n in counts if n < high), default=low)
    return {**changes, "checkpointing": "full" if high == total else str(high)}


def _plain_first(
    bench: Workbench, recipe: Recipe, changes: dict, ahead: tuple[Recipe, ...] = ()
) -> None:
    """Trace ``changes`` with no block recomputed before any count of them: one trace of
    the plain step, cheaper than a count's (which traces short versions of the model in
    two stretches), puts the first line through both ends, and the first round lands on
    or next to the answer where a bisection takes several rounds. The counts need not lie
    on the line (on Llama-3-8B one block recomputed reads higher than none; on the 70B
    plan the line predicts 76 blocks where 77 is the answer): the neighbour traced with
    the guess, or the next round, settles the answer."""
    plain = _plain(recipe, changes)
    bench.prefetch([plain], ahead=list(ahead))
    bench.estimate(plain)


def _line_ends(
    bench: Workbench, recipe: Recipe, changes: dict, total: int
) -> tuple[dict[int, int], int]:
    """The first line's ends, read off the traced steps with none and with all ``total``
    blocks recomputed (compared bytes by count), and the usable line."""
    full = bench.estimate(_apply(recipe, changes)).verdict
    plain = bench.estimate(_plain(recipe, changes)).verdict
    return {0: plain.compared_bytes, total: full.compared_bytes}, full.usable_bytes


def _plain(recipe: Recipe, changes: dict) -> Recipe:
    """``changes`` with no block recomputed: the low end of ``_selective``'s first line."""
    return _apply(recipe, {**changes, "checkpointing": "none"})


def _recomputable(bench: Workbench, recipe: Recipe) -> int:
    """The blocks of ``recipe``'s model that recompute one by one (0 where none can):
    one meta build tells."""
    built = bench.model_of(recipe)
    return built.blocks if built.enable_checkpointing is not None and built.blocks else 0


def _first_round(bench: Workbench, recipe: Recipe, changes: dict) -> list[Recipe]:
    """What ``_selective`` traces first for ``changes`` (with every block recomputed): the
    step with none recomputed, then the counts the line through both ends predicts."""
    total = _recomputable(bench, recipe)
    if not total:
        return []
    plain = _plain(recipe, changes)
    if not bench.known(plain):
        return [plain]
    points, usable = _line_ends(bench, recipe, changes, total)
    return _counted(recipe, changes, _round_counts(points, 0, total, usable, bench.width))


def _round_counts(
    points: dict[int, int], low: int, high: int, usable: int, parts: int, guessing: bool = True
) -> list[int]:
    """The counts a round of ``_selective`` traces inside the bracket (low, high): around
    the boundary the line through its ends predicts (``guessing``, and both ends traced),
    else ``parts`` counts splitting it evenly.

    >>> _round_counts({0: 300, 32: 100}, 0, 32, 150, 2), _round_counts({32: 100}, 0, 32, 150, 2)
    ([23, 24], [11, 21])
    """
    guess = _boundary(points, low, high, usable) if guessing else None
    return _between(low, high, parts) if guess is None else _around(guess, low, high, parts)


def _counted(recipe: Recipe, changes: dict, counts: list[int]) -> list[Recipe]:
    """``changes`` with each of ``counts`` leading blocks recomputed."""
    return [_apply(recipe, {**changes, "checkpointing": str(n)}) for n in counts]


def _boundary(points: dict[int, int], low: int, high: int, usable: int) -> int | None:
    """The fewest recomputed blocks the line through the bracket's ends ``low`` (does not
    fit) and ``high`` (fits) puts under ``usable``, inside the bracket; None where an end
    was not traced or the line does not fall.

    >>> _boundary({0: 300, 32: 100}, 0, 32, 150), _boundary({32: 100}, 0, 32, 150)
    (24, None)
    """
    if low not in points or high not in points or points[low] <= points[high]:
        return None
    share = (points[low] - usable) / (points[low] - points[high])
    return min(high - 1, max(low + 1, low + math.ceil(share * (high - low))))


def _around(guess: int, low: int, high: int, parts: int) -> list[int]:
    """The predicted boundary, and where ``parts`` traces run at once the count below it
    too (the answer fits, one fewer does not), inside the bracket (low, high).

    >>> _around(24, 0, 32, 1), _around(24, 0, 32, 2), _around(31, 30, 32, 2)
    ([24], [23, 24], [31])
    """
    return [n for n in (guess - 1, guess)[-parts:] if low < n < high]


def _between(low: int, high: int, parts: int) -> list[int]:
    """Up to ``parts`` counts splitting (low, high) evenly: the midpoint for one (a
    bisection), more where that many traces run at once.

    >>> _between(0, 32, 1), _between(0, 32, 2), _between(16, 18, 3)
    ([16], [11, 21], [17])
    """
    step = (high - low) / (parts + 1)
    return sorted({min(high - 1, max(low + 1, low + round(step * i))) for i in range(1, parts + 1)})


def _result(
    bench: Workbench,
    recipe: Recipe,
    name: str,
    changes: dict,
    cost: dict,
    baseline: Estimate,
    throughput: Throughput | None,
) -> LeverResult:
    changed = _apply(recipe, changes)
    estimate = bench.estimate(changed)
    cost = dict(cost)
    if changes.get("checkpointing", "none") != "none" and throughput is not None:
        cost["recompute_fraction"] = round(throughput.recompute_fraction(changed), 4)
    if "grad_accum" in changes:
        cost["micro_steps_per_optimizer_step"] = changes["grad_accum"]
    if "lora_rank" in changes:
        cost["trainable_parameters"] = estimate.model.trainable_parameters
    if "quantize" in changes and throughput is not None:
        cost["dequantized_per_pass_bytes"] = throughput.dequantized_bytes(changed)
    host = estimate.details.get("host_bytes")
    if host:
        cost["host_bytes"] = sum(host.values())
    saved = baseline.peak.device_total_bytes - estimate.peak.device_total_bytes
    tensors = baseline.peak.allocated_bytes - estimate.peak.allocated_bytes
    return LeverResult(name, changes, estimate, saved, cost, tensors)


def plan_levers(bench: Workbench, recipe: Recipe) -> PlanResult:
    """Every lever alone, ranked in the standard order, then the first plan that fits.
    The step as it is, each lever and two micro-batches are traced side by side where
    workers run; the trials that need the step's figures follow."""
    candidates = _candidates(bench, recipe)
    wants_blocks = any("checkpointing" in changes for _, changes, _ in candidates)
    if wants_blocks and not bench.model_of(recipe).blocks:  # nothing repeats: no blocks
        candidates = [c for c in candidates if "checkpointing" not in c[1]]
    halves = _halves(recipe) if recipe.is_training and _accumulation_trials(recipe, {}) else None
    bench.prefetch(
        [recipe, *(_apply(recipe, changes) for _, changes, _ in candidates)]
        + ([_apply(recipe, halves)] if halves is not None else [])
    )
    baseline = bench.estimate(recipe)
    throughput = Throughput(bench) if recipe.is_training else None
    if throughput is not None:
        throughput.count(recipe, step_flops(bench, recipe))
    finetuning = _finetune_candidates(bench, recipe)
    candidates += finetuning
    bench.prefetch(
        [_apply(recipe, changes) for _, changes, _ in finetuning]
        + [_apply(recipe, trial) for trial in _first_trials(bench, recipe, baseline)]
    )
    levers = [
        _result(bench, recipe, name, changes, cost, baseline, throughput)
        for name, changes, cost in candidates
    ]
    if recipe.is_training and recipe.batch_size > 1 and not recipe.optimizer_in_backward:
        accumulation = _accumulation_row(bench, recipe, baseline)
        if accumulation is not None:
            levers.append(
                _result(
                    bench, recipe, "gradient accumulation", accumulation, {}, baseline, throughput
                )
            )
    levers += _sharding_levers(bench, recipe, baseline)
    notes = [_sharding_note(bench.layout)]
    plan = None
    if baseline.verdict.status != "fits":
        plan = _first_plan(bench, recipe, levers, baseline, throughput)
        if throughput is not None and plan is not None:
            notes.append(throughput.note)
    if baseline.verdict.status != "fits" and plan is None:
        notes.append(_nothing_fits_note(baseline, levers))
    return PlanResult(baseline, tuple(levers), plan, tuple(notes))


def _nothing_fits_note(baseline: Estimate, levers: list[LeverResult]) -> str:
    """Why no plan fits: the card is too small, or only the high ends of the ranges pass
    its line (a plan needs the high end under it). Then the step or lever that reads least
    at the central figure, under the line, and the unknown its range is widest for."""
    rows = [("the step as it is", baseline), *((lever.name, lever.estimate) for lever in levers)]
    under = [
        (estimate.verdict.central_bytes, name, estimate)
        for name, estimate in rows
        if estimate.verdict.central_bytes <= estimate.verdict.usable_bytes
    ]
    if not under:
        return (
            "no combination of these levers fits this card at this batch: "
            "a larger card, or sharding across GPUs, is needed"
        )
    central, name, estimate = min(under, key=lambda row: row[0])
    verdict = estimate.verdict
    widest = estimate.details.get("range", {}).get("widest", "")
    unknown = SETTLES.get(widest, "the runtime terms")
    return (
        "no combination of these levers reads FITS at the high end of its range, which a "
        f"plan needs: {name} needs {format_bytes(central)} at the central figure, under the "
        f"{format_bytes(verdict.usable_bytes)} usable, and up to "
        f"{format_bytes(verdict.compared_bytes)} depending on {unknown}; "
        "`vramplan calibrate` on the card settles it"
    )


def _sharding_levers(bench: Workbench, recipe: Recipe, baseline: Estimate) -> list[LeverResult]:
    """The shardings beyond the bench's layout on its GPUs (``further.py``), each one rank's
    figures at the baseline recipe."""
    found = []
    for name, layout, flags in further(bench.layout):
        estimate = bench.under(layout).estimate(recipe)
        saved = baseline.peak.device_total_bytes - estimate.peak.device_total_bytes
        tensors = baseline.peak.allocated_bytes - estimate.peak.allocated_bytes
        cost = {"note": f"{layout.describe()} on the same {layout.data_parallel} GPUs"}
        found.append(LeverResult(name, {}, estimate, saved, cost, tensors, flags))
    return found


def _sharding_note(layout: ParallelLayout) -> str:
    """What the table says of sharding: on one GPU, the GPUs-needed answer's; under the
    user's layout, the figures are one rank's and further sharding is in the table."""
    if layout == ParallelLayout():
        return (
            "sharding (ZeRO/FSDP) and CPU offload are not levers in this table: the GPUs-needed "
            "answer covers them (per-rank ZeRO layouts, FSDP2 traced)"
        )
    return (
        f"every figure is one rank's of {layout.describe()}; the shardings that go further on "
        "the same GPUs are levers of the table (not combined into the plan), more GPUs are "
        "the GPUs-needed answer's"
    )


# -- the first plan ------------------------------------------------------------------------

COSTED_KEYS = ("checkpointing", "activation_offload", "batch_size", "grad_accum")
"""What the levers that cost throughput change (the rest of a plan costs nothing)."""
IN_BACKWARD = "optimizer step in backward"
"""Free too, but it cannot accumulate gradients: it joins the plans that keep the batch."""


@dataclass(frozen=True)
class _Tier:
    """Plans that train the same thing: each base (a precision, perhaps adapters) with
    the free levers that suit it."""

    bases: tuple[tuple[tuple[str, ...], dict], ...]
    free: tuple[tuple[LeverResult, ...], ...]
    """Sets of free levers to try on each base, in order, until one fits."""
    leanest: tuple[tuple[LeverResult, ...], ...]
    """The sets that leave the most room (a paged optimizer's rather than a plain one's):
    where none of them fits a base with every costed lever, nothing does."""
    first_base_wins: bool
    """Full training keeps mixed precision whenever it fits at all (bf16 weights round
    small updates away, whatever they save); adapters compete on time."""


def _first_plan(
    bench: Workbench,
    recipe: Recipe,
    levers: list[LeverResult],
    baseline: Estimate,
    throughput: Throughput | None,
) -> LeverResult | None:
    """The plan that fits with the least modelled step time. Full training comes first
    (precision, a fused or 8-bit optimizer, the optimizer step in backward, a chunked
    loss; then checkpointing, activation offloading or gradient accumulation); only
    when none of it fits, LoRA and QLoRA. Among the plans of a tier that fit, the
    cheapest in throughput wins (``throughput.py``): the user's batch is kept where a
    memory lever allows it at less cost than accumulating; checkpointing is trimmed to
    the fewest blocks, and free levers the plan does not need are dropped."""
    by_name = {lever.name: lever for lever in levers}
    precisions = [lever for lever in levers if "precision" in lever.changes] or [None]
    full_bases = tuple(
        (((p.name,) if p else ()), dict(p.changes) if p else {})
        for p in precisions
        if p is None or _weights_leave_room(p.estimate)
    )
    in_backward = by_name.get(IN_BACKWARD)
    free_full = []
    for optimizer in ("8-bit Adam", "paged 8-bit AdamW"):  # paged: when plain does not fit
        levers_in = [by_name.get(n) for n in ("fused optimizer", optimizer, "chunked loss")]
        free = tuple(lever for lever in levers_in if lever is not None)
        with_step = ((*free, in_backward),) if in_backward is not None else ()
        free_full += [s for s in (*with_step, free) if s not in free_full]
    paged = by_name.get("paged 8-bit AdamW")
    leanest = tuple(f for f in free_full if paged is None or paged in f)
    tiers = [_Tier(full_bases, tuple(free_full), leanest, True)]
    adapters = [by_name[n] for n in FINETUNE_LEVERS if n in by_name]
    if adapters:
        leanest = precisions[-1]  # a frozen base needs no fp32 master weights
        bases = _adapter_bases(adapters, leanest)
        chunked = by_name.get("chunked loss")
        free = ((chunked,) if chunked else (),)
        tiers.append(_Tier(bases, free, free, False))
    checkpointable = "activation checkpointing" in by_name
    for tier in tiers:
        found = _cheapest(bench, recipe, tier, throughput, checkpointable)
        if found is not None:
            names, changes, free = found
            cost = {}
            if throughput is not None:
                cost["modelled_overhead"] = round(
                    throughput.step_time(_apply(recipe, changes)).overhead, 4
                )
            for adapter in adapters:
                if adapter.name in names:
                    cost = {**adapter.cost, **cost}
            label = " + ".join([*names, *(f.name for f in free), *_costed_names(recipe, changes)])
            return _result(bench, recipe, label, changes, cost, baseline, throughput)
    return None


def _adapter_bases(
    adapters: list[LeverResult], precision: LeverResult | None
) -> tuple[tuple[tuple[str, ...], dict], ...]:
    """Each adapter lever over the ``precision`` lever's base: (names, changes). LoRA keeps
    the whole base as that lever stores it and adds adapters, so where those weights
    alone do not fit (``_weights_leave_room``) no LoRA plan does: it is left out, and its
    floor is not traced. QLoRA quantizes the base: it stays."""
    head = ((precision.name,), dict(precision.changes)) if precision else ((), {})
    return tuple(
        ((*head[0], a.name), {**head[1], **a.changes})
        for a in adapters
        if precision is None or "quantize" in a.changes or _weights_leave_room(precision.estimate)
    )


def _costed_names(recipe: Recipe, changes: dict) -> list[str]:
    names = []
    if changes.get("checkpointing", recipe.checkpointing) != recipe.checkpointing:
        names.append("activation checkpointing")
    if changes.get("activation_offload") and not recipe.activation_offload:
        names.append("activation offloading")
    if "grad_accum" in changes:
        names.append("gradient accumulation")
    return names


def _merged(base: dict, free: tuple[LeverResult, ...]) -> dict:
    changes, names = dict(base), []
    for lever in free:
        changes, names = combined(changes, names, lever)
    return changes


def _cheapest(
    bench: Workbench,
    recipe: Recipe,
    tier: _Tier,
    throughput: Throughput | None,
    checkpointable: bool,
) -> tuple[tuple[str, ...], dict, tuple[LeverResult, ...]] | None:
    """The fitting plan of ``tier`` with the least modelled step time: (base names,
    changes, free levers kept). Each base with every block recomputed is traced first
    (``_viable`` asks for it), its plain step and next floor on the workers left idle."""
    best: tuple[float, tuple[str, ...], dict, tuple[LeverResult, ...]] | None = None
    ckpt = {"checkpointing": "full"} if checkpointable else {}
    bench.prefetch(
        [
            _apply(recipe, {**_merged(base, free), **ckpt})
            for _, base in tier.bases
            for free in tier.leanest
        ],
        ahead=[trial for _, base in tier.bases for trial in _openers(recipe, tier, base, ckpt)],
    )
    for i, (names, base) in enumerate(tier.bases):
        leanest = [_merged(base, free) for free in tier.leanest]
        following = tuple(  # the next base's, on workers this one leaves idle
            trial
            for _, after in tier.bases[i + 1 : i + 2]
            for trial in _openers(recipe, tier, after, ckpt)
        )
        if not _viable(bench, recipe, leanest, checkpointable, following):
            continue  # the leanest free levers with every costed one do not fit: none do
        for free in tier.free:
            changes = _merged(base, free)
            variants = _fitting_variants(bench, recipe, changes, throughput, best, checkpointable)
            for variant in variants:
                seconds = throughput.step_time(_apply(recipe, variant)).seconds if throughput else 0
                if best is None or seconds < best[0]:
                    best = (seconds, names, variant, free)
            if variants:
                break  # the base fits: the next sets are for when it does not
        if best is not None and (tier.first_base_wins or throughput is None):
            break
    if best is None:
        return None
    _, names, changes, free = best
    return _without_unneeded(bench, recipe, names, changes, free, tier)


def _openers(recipe: Recipe, tier: _Tier, base: dict, ckpt: dict) -> list[Recipe]:
    """What a base is asked for after every block recomputed at the user's batch: its
    step with the tier's first free levers as they are (``_fitting_variants``), and with
    each set of the leanest at the next floor (``_viable``)."""
    floors = [_floors(recipe, _merged(base, free), bool(ckpt)) for free in tier.leanest]
    nexts = [f[1] for f in floors if len(f) > 1 and not _dear(recipe, f[1])]
    return [_apply(recipe, _merged(base, tier.free[0])), *nexts]


def _dear(recipe: Recipe, rung: Recipe) -> bool:
    """Whether ``rung`` offloads activations where ``recipe`` does not: offloading with
    every block checkpointed is traced in stretches of five blocks or whole, the dearest
    trace of a plan. It is traced when asked for, never ahead: where it is not needed, it
    holds a worker a trace that is needed waits for."""
    return rung.activation_offload and not recipe.activation_offload


def _fitting_variants(
    bench: Workbench,
    recipe: Recipe,
    changes: dict,
    throughput: Throughput | None,
    best: tuple | None,
    checkpointable: bool,
) -> list[dict]:
    """The ways ``changes`` fit at the least cost each: as they are; at the user's batch
    with the fewest recomputed blocks, or all of them and activation offloading; with the
    fewest micro-batches (and the fewest recomputed blocks). Nothing when even every
    costed lever at once does not fit. Workers left idle trace the next ways ahead:
    offloading, then the micro-batches; or, where every block recomputed is known to fit,
    the first traces of the fewest (``_first_round``)."""
    training = recipe.is_training
    ckpt = {"checkpointing": "full"} if checkpointable else {}
    offload = {"activation_offload": True} if training and not recipe.activation_offload else {}
    can_accumulate = (
        training
        and recipe.batch_size > 1
        and not changes.get("optimizer_in_backward")
        and not recipe.optimizer_in_backward
    )
    micro_batches = [
        _apply(recipe, trial)
        for trial in (_accumulation_trials(recipe, {**changes, **ckpt}) if can_accumulate else [])
    ]
    offloaded = _apply(recipe, {**changes, **ckpt, **offload})
    checkpointed = _apply(recipe, {**changes, **ckpt})
    if ckpt and bench.known(checkpointed) and bench.fits(checkpointed):
        ahead = _first_round(bench, recipe, {**changes, **ckpt})  # then ``_selective``
    else:
        ahead = [offloaded] if offload else micro_batches
    bench.prefetch([_apply(recipe, changes), checkpointed], ahead=ahead)
    if bench.fits(_apply(recipe, changes)):
        return [changes]
    found = []

    def selective(costed: dict) -> dict:  # the FLOPs its step time counts traced ahead
        counted = throughput.counting(_apply(recipe, costed)) if throughput else []
        return _selective(bench, recipe, costed, tuple(counted))

    if ckpt and bench.fits(_apply(recipe, {**changes, **ckpt})):
        found.append(selective({**changes, **ckpt}))
    elif not _viable(bench, recipe, [changes], checkpointable):
        return []
    elif offload and not _offload_overflows(bench, _apply(recipe, {**changes, **ckpt})):
        bench.prefetch([offloaded], ahead=micro_batches)
        if bench.fits(offloaded):
            found.append(selective({**changes, **ckpt, **offload}))
    if (
        can_accumulate
        and not _resident_overflows(bench, _apply(recipe, {**changes, **ckpt}))
        and not _costs_more(bench, recipe, changes, throughput, found, best)
    ):
        for costed in ({**changes, **ckpt}, {**changes, **ckpt, **offload}):
            trial = _accumulate(bench, recipe, costed)
            if trial is not None:
                found.append(selective(trial))
                break
    return found


def _viable(
    bench: Workbench,
    recipe: Recipe,
    options: list[dict],
    checkpointable: bool,
    then: tuple[Recipe, ...] = (),
) -> bool:
    """Whether any of ``options`` (changes) fits with some costed lever, asking the
    lightest traces first (``_floors``): every block recomputed at the user's batch
    (``_fitting_variants`` asks for it next), then at one sample per micro-batch, and only
    then with activation offloading too (the floor: offloading with every block
    checkpointed is traced in stretches of five blocks or whole, the dearest trace of a
    plan, needed only where nothing lighter fits). The options climb their ladders
    together, each round traced side by side where workers run (the next rung, then
    ``then``, on the workers it leaves idle; not an offloaded one, which costs more
    than the rest together: ``_dear``); an option whose weights,
    gradients and state pass the line alone (``_resident_overflows``) climbs no further,
    nor to offloading where what its step holds besides activations does
    (``_offload_overflows``)."""
    ladders = [_floors(recipe, changes, checkpointable) for changes in options]
    while ladders:
        ahead = [ladder[1] for ladder in ladders if len(ladder) > 1]
        ahead = [rung for rung in ahead if not _dear(recipe, rung)]
        bench.prefetch([ladder[0] for ladder in ladders], ahead=[*ahead, *then])
        climbing = []
        for first, *heavier in ladders:
            if bench.fits(first):
                return True
            if heavier and heavier[0] == first.with_changes(activation_offload=True):
                heavier = [] if _offload_overflows(bench, first) else heavier
            if heavier and not _resident_overflows(bench, first):
                climbing.append(heavier)
        ladders = climbing
    return False


def _resident_overflows(bench: Workbench, recipe: Recipe) -> bool:
    """Whether what ``recipe``'s step holds whatever its micro-batch, checkpointing or
    offloading (``Workbench.resident_bytes``: weights, gradients, optimizer state) is past
    the usable line by itself: then no such variant fits, and none is traced."""
    resident = bench.resident_bytes(recipe)
    return resident is not None and resident > bench.estimate(recipe).verdict.usable_bytes


def _offload_overflows(bench: Workbench, recipe: Recipe) -> bool:
    """Whether ``recipe``'s step with its activations offloaded cannot fit: the floor
    under its device total (``Workbench.offloaded_floor_bytes``) is past the usable line.
    Then it is not traced."""
    floor = bench.offloaded_floor_bytes(recipe)
    return floor is not None and floor > bench.estimate(recipe).verdict.usable_bytes


def _floors(recipe: Recipe, changes: dict, checkpointable: bool) -> list[Recipe]:
    """``changes`` with ever more costed levers, the last of them all at once: every block
    recomputed; then one sample per micro-batch (where gradients can accumulate); then
    activations offloaded too (the floor).

    >>> [(r.batch_size, r.checkpointing, r.activation_offload)
    ...  for r in _floors(Recipe(batch_size=4), {}, True)]
    [(4, 'full', False), (1, 'full', False), (1, 'full', True)]
    """
    if not recipe.is_training:
        return [_apply(recipe, changes)]
    trials = [dict(changes, **({"checkpointing": "full"} if checkpointable else {}))]
    if recipe.batch_size > 1 and not (
        changes.get("optimizer_in_backward") or recipe.optimizer_in_backward
    ):
        trials.append(
            {**trials[-1], "batch_size": 1, "grad_accum": recipe.grad_accum * recipe.batch_size}
        )
    if not recipe.activation_offload:
        trials.append({**trials[-1], "activation_offload": True})
    return [_apply(recipe, trial) for trial in trials]


def _weights_leave_room(estimate: Estimate) -> bool:
    """Whether the weights alone (as a precision lever stores them) are under the usable
    line: full training with fp32 master weights cannot fit otherwise. Under a sharded
    layout, the parameters one rank holds at its peak (its shards, and the blocks gathered
    there)."""
    weights = estimate.model.parameter_bytes
    if "parallel" in estimate.details:
        weights = estimate.components[Component.PARAMETERS]
    return weights < estimate.verdict.usable_bytes


def _costs_more(
    bench: Workbench,
    recipe: Recipe,
    changes: dict,
    throughput: Throughput | None,
    found: list[dict],
    best: tuple | None,
) -> bool:
    """Whether accumulating (two micro-batches at least) cannot beat what is found."""
    if throughput is None:
        return bool(found)
    times = [throughput.step_time(_apply(recipe, f)).seconds for f in found]
    times += [best[0]] if best is not None else []
    if not times or recipe.batch_size % 2:
        return False
    halves = _apply(recipe, {**changes, "batch_size": recipe.batch_size // 2,
                             "grad_accum": recipe.grad_accum * 2})  # fmt: skip
    parameters = bench.estimate(_apply(recipe, changes)).model.parameter_bytes
    return throughput.at_least(halves, parameters) >= min(times)


def _without_unneeded(
    bench: Workbench,
    recipe: Recipe,
    names: tuple[str, ...],
    changes: dict,
    free: tuple[LeverResult, ...],
    tier: _Tier,
) -> tuple[tuple[str, ...], dict, tuple[LeverResult, ...]]:
    """The plan without the free levers it fits without (the last to join dropped
    first): fewer changes to make, the same modelled time. Where the plan recomputes
    some blocks, each trial is traced first with every block recomputed: that step holds
    less (memory falls as more blocks recompute, as ``_selective`` has it), so where it
    does not fit, neither does the plan's, whose partly checkpointed trace costs several
    times more. The next trials are traced ahead as if each lever stays (a plan that just
    fits needs them), then the partly checkpointed trace, on a worker left idle."""
    base = next(b for n, b in tier.bases if n == names)
    costed = {k: changes[k] for k in COSTED_KEYS if k in changes}
    lighter = [costed]  # the checks of each trial, the lightest first
    if str(costed.get("checkpointing", "")).isdigit():
        lighter.insert(0, {**costed, "checkpointing": "full"})
    first = lighter[0]
    kept = list(free)
    for i, lever in enumerate(reversed(free)):
        trial = [f for f in kept if f is not lever]
        checks = [_apply(recipe, {**_merged(base, tuple(trial)), **c}) for c in lighter]
        ahead = [  # the next trials' first checks, should this lever stay
            _apply(recipe, {**_merged(base, tuple(f for f in kept if f is not later)), **first})
            for later in list(reversed(free))[i + 1 :]
        ]
        bench.prefetch(checks[:1], ahead=[*ahead, *checks[1:]])
        if all(bench.fits(check) for check in checks):  # asked in turn: none after a miss
            kept = trial
    return names, {**_merged(base, tuple(kept)), **costed}, tuple(kept)


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
