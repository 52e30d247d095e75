"""A modelled step time, to rank the plans that fit by what they cost in throughput.

Each fitting plan's optimizer step (the same samples whatever the micro-batch) is priced
on the card's datasheet peaks (``data/gpu_rates.json``) by three mechanisms:

- compute: the step's matmul FLOPs, counted by PyTorch's FlopCounterMode on the fake step
  (recomputed blocks included: checkpointing N of L identical blocks adds N/L of what
  recomputing all of them adds, so two counted traces price every N);
- weight traffic: every micro-step reads the stored weights in forward, in backward and
  again for the recomputed blocks, and a 4-bit or int8 base first writes and reads back
  each weight dequantized to the compute dtype (bitsandbytes' ``MatMul4Bit``,
  ``sources/quantized.py``): so gradient accumulation and QLoRA cost bandwidth per
  micro-step;
- host traffic: offloaded activations go to the host in forward and come back in
  backward; torchtune overlaps the copies with compute on a side stream, so only the part
  longer than the compute shows. A paged optimizer's state, counted off the card, pages in
  for the optimizer step and out again (bitsandbytes' managed memory), with nothing to
  hide behind.

Peaks overstate every rate alike, so the figure ranks plans rather than predicting
seconds::

    model = Throughput(bench)
    model.step_time(recipe).seconds    # e.g. 2.41 on an RTX 4090
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

from vramplan.planner.bench import Workbench, recipe_key
from vramplan.recipe import Recipe
from vramplan.sources.quantized import QuantizedLinear
from vramplan.trace.loop import ITERATIONS, micro_steps

REFERENCE_CARD = "A100-80GB"
"""Whose rates price the plans on a card the catalog does not name (``--gpu-memory``)."""


@dataclass(frozen=True)
class CardRates:
    """A card's datasheet peaks, per second."""

    card: str
    tensor_flops: float
    memory_bytes: float
    host_bytes: float


@cache
def _rates() -> dict[str, CardRates]:
    data = json.loads((resources.files("vramplan") / "data" / "gpu_rates.json").read_text())
    return {
        name: CardRates(
            name, row["tensor_tflops"] * 1e12, row["memory_gbps"] * 1e9, row["host_gbps"] * 1e9
        )
        for name, row in data["rates"].items()
    }


def rates_for(card: str) -> CardRates:
    """The catalog card's rates, or the reference card's for an unnamed one.

    >>> rates_for("RTX-4090").memory_bytes, rates_for("custom (24GiB)").card
    (1008000000000.0, 'A100-80GB')
    """
    return _rates().get(card, _rates()[REFERENCE_CARD])


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's modelled seconds, by mechanism."""

    compute: float
    weights: float
    host: float

    @property
    def seconds(self) -> float:
        return self.compute + self.weights + self.host

    @property
    def overhead(self) -> float:
        """What weight and host traffic add to the compute, as a fraction of it."""
        return (self.weights + self.host) / self.compute if self.compute else 0.0


@dataclass
class Throughput:
    """Modelled step times of recipes on a workbench's card (FLOPs counted once per kind
    of step, then shared)."""

    bench: Workbench
    rates: CardRates = field(init=False)
    _flops: dict[str, float] = field(default_factory=dict)
    _dequantized: dict[str, int] = field(default_factory=dict)
    _block_counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rates = rates_for(self.bench.device.card.name)

    @property
    def note(self) -> str:
        """How plans are ranked, for the plan's notes."""
        unnamed = self.rates.card != self.bench.device.card.name
        whose = f"{self.rates.card}'s (no catalog card given)" if unnamed else "the card's"
        return (
            "plans that fit are ranked by a modelled step time on "
            f"{whose} datasheet peaks: counted FLOPs, weight reads and dequantization per "
            "micro-step, offloaded activations beyond what compute hides"
        )

    def step_time(self, recipe: Recipe) -> StepTime:
        """The modelled time of one optimizer step of ``recipe`` (traced if it was not)."""
        estimate = self.bench.estimate(recipe)
        time = self._without_host(recipe, estimate.model.parameter_bytes)
        host = estimate.details.get("host_bytes", {})
        offloaded = host.get("offloaded_activations", 0)
        moved = 2 * offloaded * recipe.grad_accum / self.rates.host_bytes
        paged = 2 * host.get("paged_optimizer_state", 0) / self.rates.host_bytes
        return StepTime(time.compute, time.weights, max(0.0, moved - time.compute) + paged)

    def at_least(self, recipe: Recipe, parameter_bytes: int) -> float:
        """A floor under ``recipe``'s modelled seconds whatever blocks it recomputes (none
        assumed) and whatever it offloads, with ``parameter_bytes`` stored: no trace of
        ``recipe`` itself is needed."""
        return self._without_host(
            recipe.with_changes(checkpointing="none"), parameter_bytes
        ).seconds

    def recompute_fraction(self, recipe: Recipe) -> float:
        """The FLOPs recomputation adds to ``recipe``'s step, as a fraction of the same
        step without it."""
        plain = self._flops_per_sample(recipe.with_changes(checkpointing="none"))
        return self._flops_per_sample(recipe) / plain - 1.0 if plain else 0.0

    def _without_host(self, recipe: Recipe, parameter_bytes: int) -> StepTime:
        samples = recipe.batch_size * recipe.grad_accum
        compute = self._flops_per_sample(recipe) * samples / self.rates.tensor_flops
        passes = 2 + self._recomputed_share(recipe) if recipe.is_training else 1
        per_pass = parameter_bytes + self._dequantized_bytes(recipe)
        weights = recipe.grad_accum * passes * per_pass / self.rates.memory_bytes
        return StepTime(compute, weights, 0.0)

    def dequantized_bytes(self, recipe: Recipe) -> int:
        """Bytes one pass of ``recipe``'s quantized linears writes and reads back
        dequantized (0 without a quantized base)."""
        return self._dequantized_bytes(recipe)

    # -- counted FLOPs ---------------------------------------------------------------------

    def count(self, recipe: Recipe, flops: int) -> None:
        """Share FLOPs already counted for ``recipe`` (its whole traced run)."""
        self._flops.setdefault(_kind_key(recipe), flops / _samples_traced(recipe))

    def counting(self, recipe: Recipe) -> list[Recipe]:
        """The steps whose FLOPs ``step_time`` of ``recipe`` with some of its leading
        blocks recomputed will count, those not counted yet (``_counted``: its kind's step
        with no block and with every block recomputed), for tracing ahead."""
        ends = [recipe.with_changes(checkpointing=mode) for mode in ("none", "full")]
        return [_counted_as(end) for end in ends if _kind_key(end) not in self._flops]

    def _flops_per_sample(self, recipe: Recipe) -> float:
        mode = recipe.checkpointing
        if not mode.isdigit():
            return self._counted(recipe)
        none = self._counted(recipe.with_changes(checkpointing="none"))
        full = self._counted(recipe.with_changes(checkpointing="full"))
        return none + (full - none) * int(mode) / self._blocks(recipe)

    def _recomputed_share(self, recipe: Recipe) -> float:
        mode = recipe.checkpointing
        if mode == "none":
            return 0.0
        if mode.isdigit():
            return int(mode) / self._blocks(recipe)
        return 1.0  # full, every:N and op recompute (part of) every block's forward

    def _blocks(self, recipe: Recipe) -> int:
        key = _kind_key(recipe)
        if key not in self._block_counts:
            self._block_counts[key] = self.bench.model_of(recipe).blocks or 1
        return self._block_counts[key]

    def _counted(self, recipe: Recipe) -> float:
        """FLOPs per sample of ``recipe``'s kind of step: what is trained and what is
        recomputed decide them; batch, precision, storage, quantization and optimizer do
        not (the counter counts matmuls, which a dequantized weight feeds the same)."""
        key = _kind_key(recipe)
        if key not in self._flops:
            traced = _counted_as(recipe)
            self._flops[key] = self.bench.flops(traced) / _samples_traced(traced)
        return self._flops[key]

    def _dequantized_bytes(self, recipe: Recipe) -> int:
        if recipe.quantize not in ("nf4", "fp4", "int8"):
            return 0
        key = recipe_key(recipe.with_changes(batch_size=1, grad_accum=1))
        if key not in self._dequantized:
            model = self.bench.model_of(recipe).model
            self._dequantized[key] = sum(
                2 * module.logical_numel * module.compute_dtype.itemsize
                for module in model.modules()
                if isinstance(module, QuantizedLinear)
            )
        return self._dequantized[key]


def _counted_as(recipe: Recipe) -> Recipe:
    """The step whose FLOPs count for ``recipe``'s kind: one micro-step per iteration,
    the optimizer step after the backward."""
    return recipe.with_changes(grad_accum=1, optimizer_in_backward=False)


def _samples_traced(recipe: Recipe) -> int:
    """Samples a traced run of ``recipe`` steps through (every micro-step of each
    iteration)."""
    return ITERATIONS * micro_steps(recipe) * recipe.batch_size


def _kind_key(recipe: Recipe) -> str:
    """What decides a step's FLOPs per sample: the recipe without its batch, precision,
    storage, optimizer, quantization and loss chunks (the chunks' matmuls add up to the
    whole head's)."""
    data = recipe.to_json()
    for name in ("batch_size", "grad_accum", "precision", "optimizer", "optimizer_impl",
                 "quantize", "double_quant", "compute_dtype", "bnb_version",
                 "activation_offload", "optimizer_in_backward", "weights_dtype", "keep_fp32",
                 "zero_grad", "loss_chunks"):  # fmt: skip
        data.pop(name, None)
    return json.dumps(data, sort_keys=True, default=str)
