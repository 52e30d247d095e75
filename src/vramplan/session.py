"""The front door: one model on one device setting, answering estimate, max batch, plan
and measure. Every CLI command and every convenience function goes through it, so a
notebook gets exactly what the command line prints::

    s = Session("torchvision:resnet18", gpu="t4")
    s.estimate(batch_size=64).verdict.status        # 'fits', 'tight' or 'oom'
    s.max_batch(input_shape="3x224x224").value      # the largest batch that fits
    s.plan(batch_size=512).levers.plan.flags        # e.g. '--precision amp-bf16 ...'

Traces are cached per recipe, so asking again (or planning after estimating) reuses them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from vramplan.device.catalog import lookup_gpu
from vramplan.device.measured import measured_for
from vramplan.device.options import DEFAULT_GPU, DeviceOptions, device_options
from vramplan.device.profile import profile_for
from vramplan.device.tensorflow import tensorflow_memory, with_tensorflow
from vramplan.distributed.facts import facts_of
from vramplan.distributed.fsdp import engine_for, with_traced_layout
from vramplan.distributed.layout import ParallelLayout, check_layout, per_rank
from vramplan.errors import UserError
from vramplan.limits import DEFAULT_TIMEOUT, check_timeout, time_limit, user_code_timeout
from vramplan.measurement.compare import Comparison, errors_of
from vramplan.measurement.leak import check_leak
from vramplan.measurement.run import check_device, local_card, measure_built
from vramplan.pipeline import estimate_built, trace_and_estimate
from vramplan.planner.answer import PlanAnswer, answer_plan
from vramplan.planner.bench import TraceEvent, TraceLog, Workbench, trace_label
from vramplan.planner.host import HostOptions
from vramplan.planner.parallel import default_jobs
from vramplan.planner.search import SearchResult, largest_fitting
from vramplan.planner.serving import ServeOptions, ServingPlan, plan_serving
from vramplan.recipe import Recipe
from vramplan.result import Estimate
from vramplan.sources import BuiltModel, resolve, with_source
from vramplan.sources.user_code import leading_dim, module_source
from vramplan.trace.events import Trace
from vramplan.units import parse_bytes

TARGETS = ("cuda", "cpu")
FRAMEWORKS = ("pytorch", "tensorflow")
SEARCHES = {
    "batch_size": "batch_size",
    "batch-size": "batch_size",
    "seq_len": "seq_len",
    "seq-len": "seq_len",
    "prompt_len": "prompt_len",
    "prompt-len": "prompt_len",
    "new_tokens": "new_tokens",
    "new-tokens": "new_tokens",
}
TENSORFLOW_NOTE = (
    "TensorFlow reserves nearly the whole card at start-up unless memory growth is on "
    "(tf.config.experimental.set_memory_growth); nvidia-smi then shows the card as full "
    "whatever the model needs. This estimate is the PyTorch step's memory."
)


def _limited(method):
    """Run a question with the session's time limit on user code (factories, steps)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with user_code_timeout(self.timeout):
            return method(self, *args, **kwargs)

    return run


class Session:
    """A model (a source name such as ``hf:gpt2``, or an ``nn.Module`` with its example
    batch and loss) judged on one device setting: a catalog card (``gpu``) or a size
    (``gpu_memory="24GiB"``), the headroom kept free, ``PYTORCH_CUDA_ALLOC_CONF``
    (``alloc_conf``), cuDNN benchmark mode, and a measured device ``profile``.

    ``target="cpu"`` traces what the CPU itself does instead of emulating a CUDA GPU.
    ``trust_remote_code=True`` lets a Hugging Face model run the modeling code its
    repository ships (``auto_map``); off by default.
    ``progress(event)`` is called as each trace starts and ends (a ``TraceEvent``: label,
    index, seconds once done); ``Session.log`` keeps every trace's label and seconds.
    ``jobs``: processes ``plan`` and ``max_batch`` may trace in at once (None: the idle
    cores, at most ``planner.parallel.MAX_JOBS``; 1: one trace at a time).
    """

    def __init__(
        self,
        model: str | nn.Module,
        *,
        gpu: str | None = None,
        gpu_memory: str | None = None,
        headroom: float = 0.10,
        alloc_conf: str | None = None,
        cudnn_benchmark: bool = False,
        profile: str | None = None,
        stack: str | None = None,
        used_counter: str = "nvml-v1",
        target: str = "cuda",
        framework: str = "pytorch",
        example_batch: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        full_trace: bool = False,
        progress: Callable[[TraceEvent], None] | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        trust_remote_code: bool = False,
        tf_memory_growth: bool = False,
        tf_memory_limit: str | None = None,
        allow_custom_objects: bool = False,
        jobs: int | None = None,
    ) -> None:
        if target not in TARGETS:
            raise UserError(f"unknown target {target!r}; choose cuda or cpu")
        if framework not in FRAMEWORKS:
            raise UserError(f"unknown framework {framework!r}; choose pytorch or tensorflow")
        self.model = with_source(model) if isinstance(model, str) else model
        self.trust_remote_code = trust_remote_code
        self.name = self.model if isinstance(self.model, str) else type(model).__name__
        # TensorFlow's runtime (device/tensorflow.py) and Keras files (sources/keras_models.py)
        if framework != "tensorflow" and (tf_memory_growth or tf_memory_limit):
            raise UserError("--tf-memory-growth and --tf-memory-limit need --framework tensorflow")
        self.tf_memory_growth = tf_memory_growth
        self.tf_memory_limit = (
            None
            if tf_memory_limit is None
            else parse_bytes(tf_memory_limit, "TensorFlow memory limit", require_unit=True)
        )
        self.allow_custom_objects = allow_custom_objects
        self.target = target
        self.framework = framework
        self.device = device_options(
            gpu,
            gpu_memory,
            headroom,
            alloc_conf,
            cudnn_benchmark,
            profile=profile,
            stack=stack,
            used_counter=used_counter,
        )
        self._example_batch = example_batch
        self._loss_fn = loss_fn
        self.full_trace = full_trace
        """Trace every block instead of repeating a run of identical ones."""
        self.timeout = check_timeout(timeout)
        self._bench: Workbench | None = None
        if jobs is not None and jobs < 1:
            raise UserError(f"--jobs must be 1 or more, not {jobs}")
        self.jobs = jobs
        """Processes ``plan`` and ``max-batch`` trace in; None: ``default_jobs()``, read as
        the first of them starts (the cores free then, not when the session was made)."""
        self.log = TraceLog(progress)
        """Every trace this session ran, with its label and seconds."""

    # -- the questions -------------------------------------------------------------------

    @_limited
    def estimate(
        self,
        recipe: Recipe | None = None,
        *,
        layout: ParallelLayout | None = None,
        **knobs: Any,
    ) -> Estimate:
        """One step traced and judged: ``recipe`` or its knobs (``batch_size=8``,
        ``seq_len=512``, ``precision="amp-bf16"``, ...). With a ``layout``, per-rank figures:
        FSDP traced through FSDP2 on a fake process group, ZeRO/TP/PP by formula."""
        recipe = self._recipe(recipe, knobs)
        layout = layout or ParallelLayout()
        if layout == ParallelLayout() and self.framework == "tensorflow":
            return self._tensorflow(recipe)
        if layout == ParallelLayout():
            result = self._single(recipe)
        else:
            result = self._per_rank(recipe, layout)
        if self.framework == "tensorflow":
            result = result.with_changes(notes=(*result.notes, TENSORFLOW_NOTE))
        return result

    @_limited
    def max_batch(
        self,
        recipe: Recipe | None = None,
        *,
        search: str = "batch_size",
        layout: ParallelLayout | None = None,
        **knobs: Any,
    ) -> SearchResult:
        """The largest batch (``search="seq_len"``: the longest context) that fits the card
        with headroom, confirmed by tracing N (fits) and N + 1 (does not). With a
        ``layout``, the per-GPU batch whose rank fits, each judged as ``estimate`` judges
        that layout."""
        knob = SEARCHES.get(search)
        if knob is None:
            raise UserError(
                f"unknown search {search!r}; choose batch-size, seq-len, prompt-len or new-tokens"
            )
        recipe = self._recipe(recipe, knobs)
        if knob in ("prompt_len", "new_tokens"):
            if recipe.mode != "generate":
                raise UserError(f"--search {search} searches a generation: add --mode generate")
            start = getattr(recipe, knob) or (recipe.seq_len if knob == "prompt_len" else None)
            if knob == "prompt_len":
                recipe = recipe.with_changes(seq_len=None)
            return largest_fitting(self._workbench(layout=layout), recipe, knob, start=start)
        if knob == "seq_len" and not self._build(recipe).sequence:
            raise UserError(
                f"--search seq-len: {self.name} has no sequence length to search "
                "(its input is a fixed shape); search the batch size instead"
            )
        start = recipe.seq_len if knob == "seq_len" else None
        return largest_fitting(self._workbench(layout=layout), recipe, knob, start=start)

    @_limited
    def plan(
        self,
        recipe: Recipe | None = None,
        *,
        host_memory: str | int | None = None,
        workers: int = 4,
        offload_optimizer: bool = False,
        layout: ParallelLayout | None = None,
        **knobs: Any,
    ) -> PlanAnswer:
        """The levers, each traced, the first plan that fits, host RAM, and the GPUs needed
        when nothing fits one card. Without a card, every catalog GPU is judged. With a
        ``layout`` (the user's sharding), every figure is one rank's under it, and the
        shardings that go further on the same GPUs join the levers."""
        recipe = self._recipe(recipe, knobs)
        limit = (
            parse_bytes(host_memory, "host memory", require_unit=True)
            if isinstance(host_memory, str)
            else host_memory
        )
        if layout is not None and layout.offload_optimizer:
            offload_optimizer = True  # ZeRO-Offload: the optimizer state is in host RAM
        host = HostOptions(workers=workers, limit_bytes=limit, offload_optimizer=offload_optimizer)
        every_gpu = self.device.gpu is None
        bench = self._workbench(DEFAULT_GPU if every_gpu else None, layout)
        return answer_plan(bench, recipe, judge_every_gpu=every_gpu, host=host)

    @_limited
    def measure(
        self,
        recipe: Recipe | None = None,
        *,
        device: str | None = None,
        steps: int = 3,
        snapshot: str | None = None,
        **knobs: Any,
    ) -> Comparison:
        """Run ``steps`` real steps (random weights, never downloaded) on ``device``
        (``cuda`` when present, else ``cpu``) and put the estimate for that device beside
        the measurement, with relative errors and a leak check."""
        recipe = self._recipe(recipe, knobs)
        if isinstance(self.model, nn.Module):
            raise UserError(
                "measure runs a model by its source name; an nn.Module's own "
                "weights would be trained"
            )
        if recipe.mode == "generate":
            raise UserError(
                "measure runs training or inference steps; --mode generate is estimated, "
                "not measured yet"
            )
        device = check_device(device, steps)
        if snapshot is not None and device != "cuda":
            raise UserError(
                "--snapshot records CUDA's allocator history (torch.cuda.memory); "
                "it has nothing to record with --device cpu"
            )
        if device == "cuda":
            card = local_card()
            options = replace(
                self.device,
                gpu=card,
                profile=self.device.profile or profile_for(card.name),
                measured=measured_for(card.name, self.device.software.slug),
            )
            estimate = self._timed(
                recipe, lambda: estimate_built(self._build(recipe), recipe, "cuda", options)
            )
        else:
            estimate = self._timed(
                recipe, lambda: estimate_built(self._build(recipe), recipe, "cpu")
            )
        built = self._build(recipe, device)
        with time_limit(f"the measured steps of {self.name}"):
            measured = measure_built(built, recipe, device, steps, snapshot)
        return Comparison(
            estimate,
            measured,
            errors_of(estimate, measured),
            check_leak(measured.after_step_bytes),
        )

    @_limited
    def serve(self, *, precision: str = "bf16", **options: Any) -> ServingPlan:
        """What a serving engine (vLLM) reserves on this session's card and the KV cache
        left: ``gpu_memory_utilization``, ``max_model_len``, ``tp``, ``max_num_seqs``,
        ``max_num_batched_tokens``, ``kv_cache_dtype``, ``block_size`` as its flags."""
        weights = {  # quantized checkpoints: --quantize gptq|awq and their knobs
            name: options.pop(name)
            for name in ("quantize", "group_size", "quant_kernel", "act_order")
            if name in options
        }
        allowed = set(ServeOptions.__dataclass_fields__) - {"dtype"}  # given as precision
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise UserError(f"unknown serve option {unknown[0]!r}")
        serve_options = ServeOptions(**options, dtype=precision)
        if self.device.gpu is None:
            raise UserError("serve needs a card (--gpu): the engine's budget is a share of it")
        if weights.get("quantize", "none") not in ("none", "gptq", "awq", "fp8"):
            raise UserError("serve --quantize takes gptq, awq or fp8 (the checkpoints vLLM loads)")
        if weights.get("quantize", "none") != "none":  # the kernels compute in this dtype
            weights["precision"] = precision
        built = self._build(Recipe(mode="infer", **weights))
        return self.log.timed(
            f"{self.name} served by {serve_options.engine}",
            lambda: plan_serving(built, serve_options, self.device),
        )

    def batch_curve_points(self, estimate: Estimate, layout: ParallelLayout | None = None):
        """A callable ``batch → Estimate`` at ``estimate``'s other knobs (for the HTML
        report's batch curve)."""
        return lambda batch: self.estimate(
            estimate.recipe.with_changes(batch_size=batch), layout=layout
        )

    # -- the machinery -------------------------------------------------------------------

    def _recipe(self, recipe: Recipe | None, knobs: dict[str, Any]) -> Recipe:
        """The recipe; with an example batch, its batch size is the batch's."""
        recipe = _recipe(recipe, knobs)
        if self._example_batch is None:
            return recipe
        size = leading_dim(self._example_batch)
        if "batch_size" in knobs and knobs["batch_size"] != size:
            raise UserError(
                f"batch_size={knobs['batch_size']} but example_batch holds {size} samples; "
                "leave batch_size out (the example batch sets it)"
            )
        return recipe.with_changes(batch_size=size)

    def _build(self, recipe: Recipe, device: str = "meta") -> BuiltModel:
        if isinstance(self.model, nn.Module):
            built = module_source(self.model, recipe, self.name, self._example_batch, self._loss_fn)
        else:
            built = resolve(
                self.model,
                recipe,
                device,
                trust_remote_code=self.trust_remote_code,
                allow_custom_objects=self.allow_custom_objects,
            )
        built.repeat_blocks = built.copy_iteration = not self.full_trace
        if recipe.seq_len is not None and not built.sequence:
            shape = "x".join(map(str, built.default_input_shape)) or "a fixed shape"
            raise UserError(
                f"--seq-len {recipe.seq_len}: {built.name} takes no sequence (one sample is "
                f"{shape}); leave --seq-len out, or give --input-shape"
            )
        return built

    def _workbench(
        self, default_gpu: str | None = None, layout: ParallelLayout | None = None
    ) -> Workbench:
        """The trace cache on this session's card (or on ``default_gpu`` when none), its
        estimates one rank's of ``layout`` (one GPU when None)."""
        layout = layout or ParallelLayout()
        if layout != ParallelLayout() and self.framework == "tensorflow":
            raise UserError(
                "--framework tensorflow is judged on one GPU here: leave the parallel layout "
                "out, or use estimate"
            )

        def build(_name: str, recipe: Recipe) -> BuiltModel:
            return self._build(recipe)

        if default_gpu is not None and self.device.gpu is None:
            options = replace(self.device, gpu=lookup_gpu(default_gpu))
            bench = Workbench(
                self.name, options, build, self.log, self._runtime_finish(), jobs=self._jobs()
            )
            return bench.under(layout)
        if self._bench is None:
            self._bench = Workbench(
                self.name, self.device, build, self.log, self._runtime_finish(), jobs=self._jobs()
            )
        return self._bench.under(layout)

    def _jobs(self) -> int:
        return default_jobs() if self.jobs is None else self.jobs

    def _runtime_finish(self):
        """TensorFlow's runtime over each traced step when ``framework="tensorflow"``, so
        that the verdict, ``max_batch`` and ``plan`` judge what TensorFlow's allocator does
        (None: PyTorch's caching allocator, already in the estimate)."""
        if self.framework != "tensorflow":
            return None
        growth, limit = self.tf_memory_growth, self.tf_memory_limit

        def finish(result: Estimate, trace: Trace, options: DeviceOptions) -> Estimate:
            return with_tensorflow(result, tensorflow_memory(result, trace, options, growth, limit))

        return finish

    def _single(self, recipe: Recipe) -> Estimate:
        if self.target == "cuda" and self.device.gpu is not None:
            return self._workbench().estimate(recipe)
        return self._timed(
            recipe, lambda: estimate_built(self._build(recipe), recipe, self.target, self.device)
        )

    def _tensorflow(self, recipe: Recipe) -> Estimate:
        """The step with TensorFlow's runtime: its memory limit, preallocation or memory
        growth, and its BFC allocator replayed over the traced step."""
        if self.target != "cuda":
            raise UserError("--framework tensorflow models a GPU; leave --target cpu out")
        if self.device.gpu is not None:
            return self._workbench().estimate(recipe)  # TensorFlow's runtime applied there
        result, trace = self._timed(
            recipe, lambda: trace_and_estimate(self._build(recipe), recipe, "cuda", self.device)
        )
        return self._runtime_finish()(result, trace, self.device)

    def _per_rank(self, recipe: Recipe, layout: ParallelLayout) -> Estimate:
        engine = engine_for(layout)
        device = replace(self.device, data_parallel=layout.data_parallel if engine else 1)
        built = self._build(recipe)
        facts = facts_of(built)
        check_layout(layout, facts)
        what = f"FSDP rank of {layout.data_parallel}" if engine is not None else ""
        result = self._timed(
            recipe,
            lambda: estimate_built(built, recipe, self.target, device, engine=engine),
            what,
        )
        if engine is not None:
            return with_traced_layout(result, layout)
        return per_rank(result, layout, facts)

    def _timed(self, recipe: Recipe, run: Callable[[], Estimate], what: str = "") -> Estimate:
        return self.log.timed(trace_label(self.name, recipe, what), run)


def _recipe(recipe: Recipe | None, knobs: dict[str, Any]) -> Recipe:
    """``recipe``, or one made from knobs (a UserError for a bad value or for both)."""
    if recipe is not None and knobs:
        raise UserError("give a Recipe or recipe knobs, not both")
    if recipe is not None:
        return recipe
    unknown = sorted(set(knobs) - set(Recipe.__dataclass_fields__))
    if unknown:
        raise UserError(f"unknown recipe knob {unknown[0]!r}")
    return Recipe(**knobs)
