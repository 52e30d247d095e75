"""``keras:…``: Keras 3 models, traced on Keras's torch backend.

A Keras 3 model on the torch backend is an ``nn.Module`` whose layers keep their weights
as ``torch.nn.Parameter``s, so vramplan's own tracer runs its training step unchanged:
built on the meta device (``keras.device("meta")``), materialised as fake tensors, and
stepped as ``model.fit`` steps (forward with ``training=True``, the compiled loss,
backward, the optimizer update). Three forms::

    keras:ResNet50                      keras.applications, weights=None
    keras:path/model.keras              the architecture in the file's config.json only
    keras:path/to/model.py:factory      a function returning a keras.Model

Keras must run on its torch backend: vramplan sets ``KERAS_BACKEND=torch`` before it
imports Keras, and refuses when Keras was already imported with another backend.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.sources.base import Batch, BuiltModel

APPLICATIONS = ("ResNet50", "MobileNetV2", "EfficientNetB0")
"""The Keras Applications the tests check; any other ``keras.applications`` name works."""

POLICIES = {
    "fp16": "float16",
    "bf16": "bfloat16",
    "amp-fp16": "mixed_float16",
    "amp-bf16": "mixed_bfloat16",
}
"""``--precision`` → the Keras dtype policy the model is built under (fp32 keeps the
model's own policies)."""

OPTIMIZERS = {
    "Adam": "adam",
    "AdamW": "adamw",
    "RMSprop": "rmsprop",
    "Adagrad": "adagrad",
    "Lion": "lion",
    "Adafactor": "adafactor",
}
"""Keras optimizer class → the vramplan optimizer with the same state per weight
(Adam/AdamW: two moments; RMSprop: one mean square; SGD: none, or one with momentum)."""


KERAS_OPTIMIZERS = {
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "sgd": ("SGD", {}),
    "momentum": ("SGD", {"momentum": 0.9}),
    "rmsprop": ("RMSprop", {}),
    "adagrad": ("Adagrad", {}),
    "lion": ("Lion", {}),
    "adafactor": ("Adafactor", {}),
}
"""``--optimizer`` → the Keras optimizer class (and arguments) whose own update is traced."""


def policy_for(precision: str) -> str | None:
    """The Keras dtype policy a ``--precision`` stands for (None: the model's own).

    >>> policy_for("amp-bf16"), policy_for("fp32")
    ('mixed_bfloat16', None)
    """
    return POLICIES.get(precision)


def import_keras():
    """Keras on its torch backend (``KERAS_BACKEND=torch`` set before the first import).

    Keras writes ``~/.keras/keras.json`` on its first import when it is missing; vramplan
    points ``KERAS_HOME`` at a temporary folder then, so that nothing of the user's changes.
    """
    module = sys.modules.get("keras")
    if module is None:
        os.environ["KERAS_BACKEND"] = "torch"
        home = Path(os.environ.get("KERAS_HOME", Path.home() / ".keras"))
        if "KERAS_HOME" not in os.environ and not (home / "keras.json").exists():
            os.environ["KERAS_HOME"] = tempfile.mkdtemp(prefix="vramplan-keras-")
        try:
            import keras as module
        except ImportError:
            raise UserError("keras is not installed: pip install 'vramplan[keras]'") from None
    backend = module.backend.backend()
    if backend != "torch":
        raise UserError(
            f"keras was already imported with the {backend} backend; vramplan traces Keras "
            "on its torch backend: set KERAS_BACKEND=torch before importing keras"
        )
    return module


def keras_optimizer_name(optimizer: Any) -> str | None:
    """The vramplan ``--optimizer`` with the state of a Keras optimizer (None: unknown); a
    ``LossScaleOptimizer`` has its inner optimizer's.

    >>> class SGD:
    ...     momentum = 0.9
    >>> keras_optimizer_name(SGD())
    'momentum'
    """
    if optimizer is None:
        return None
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    name = type(optimizer).__name__
    if name == "SGD":
        return "momentum" if getattr(optimizer, "momentum", 0.0) else "sgd"
    return OPTIMIZERS.get(name)


class KerasOptimizer(torch.optim.Optimizer):
    """Keras's own optimizer behind ``torch.optim.Optimizer``'s interface: ``step()`` runs
    ``keras_optimizer.apply`` (on the torch backend, ``torch._foreach_*`` updates with their
    temporaries, e.g. Adam's ``m * alpha``, ``sqrt(v)``, ``sqrt(v) + eps`` and their
    quotient at once; a ``LossScaleOptimizer``'s finiteness check and unscaled copy of
    every gradient), so the tracer's optimizer hooks see the step, and ``state`` holds the
    variables Keras creates on its first step (moments, velocities)."""

    def __init__(self, keras, keras_optimizer, model, params: list[nn.Parameter]) -> None:
        super().__init__(params, {})
        self.keras, self.keras_optimizer, self.model = keras, keras_optimizer, model

    @torch.no_grad()
    def step(self, closure=None) -> None:
        weights = list(self.model.trainable_weights)
        grads = [weight.value.grad for weight in weights]
        device = self.param_groups[0]["params"][0].device
        with self.keras.device(str(device)), _traced_conditions():
            self.keras_optimizer.apply(grads, weights)
        self.state["keras"] = {
            variable.path: variable.value
            for variable in self.keras_optimizer.variables
            if variable.value.dim() > 0
        }


def _fresh_optimizer(keras, optimizer: Any) -> Any:
    """A new, unbuilt optimizer of ``optimizer``'s class and arguments. One that
    ``model.compile`` made on the meta device (in the user's factory, or replayed from a
    file's compile config) keeps its learning rate as a variable without a value for
    ``get_config`` to read: the copy gets a placeholder rate instead (a scalar either
    way; it sizes nothing)."""
    rate = optimizer._learning_rate
    if isinstance(rate, keras.Variable) and rate.value.device.type == "meta":
        optimizer._learning_rate = 1e-3
        try:
            config = optimizer.get_config()
        finally:
            optimizer._learning_rate = rate
    else:
        config = optimizer.get_config()
    return type(optimizer).from_config(config)


def _custom_modules(config: Any) -> Iterator[str]:
    """Modules outside Keras that a serialized config names (Keras imports them)."""
    if isinstance(config, dict):
        module = config.get("module")
        if isinstance(module, str) and "class_name" in config and module.split(".")[0] != "keras":
            yield module
        for value in config.values():
            yield from _custom_modules(value)
    elif isinstance(config, list):
        for value in config:
            yield from _custom_modules(value)


def _set_policies(config: Any, policy: str) -> Any:
    """``config`` with every layer's DTypePolicy renamed to ``policy``."""
    if isinstance(config, dict):
        if config.get("class_name") == "DTypePolicy" and isinstance(config.get("config"), dict):
            return {**config, "config": {**config["config"], "name": policy}}
        return {k: _set_policies(v, policy) for k, v in config.items()}
    if isinstance(config, list):
        return [_set_policies(v, policy) for v in config]
    return config


def read_keras_file(path: Path, allow_custom_objects: bool) -> dict:
    """The ``config.json`` of a ``.keras`` zip: the architecture (and compile config),
    never the weights. Custom objects (classes from modules outside Keras) are refused
    unless ``allow_custom_objects``: deserializing them imports the user's modules."""
    if not path.is_file():
        raise UserError(f"Keras file not found: {path}")
    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
    except (zipfile.BadZipFile, KeyError, json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(
            f"{path} is not a Keras 3 .keras file (a zip holding config.json); "
            "legacy .h5 files are not read"
        ) from None
    custom = sorted(set(_custom_modules(config)))
    if custom and not allow_custom_objects:
        raise UserError(
            f"{path} names custom objects from {', '.join(custom)}; loading them imports "
            "that code: pass --allow-custom-objects to allow it"
        )
    return config


class KerasBuild:
    """What building a Keras model under a dtype policy needs: the policy set around the
    build on the meta device, then restored."""

    def __init__(self, keras, policy: str | None) -> None:
        self.keras = keras
        self.policy = policy

    def __call__(self, build) -> Any:
        keras = self.keras
        previous = keras.config.dtype_policy()
        if self.policy is not None:
            keras.config.set_dtype_policy(self.policy)
        try:
            with keras.device("meta"):
                return build()
        finally:
            keras.config.set_dtype_policy(previous)


def _application(keras, name: str):
    factory = getattr(keras.applications, name, None)
    if not callable(factory) or name[:1].islower():
        known = sorted(n for n in dir(keras.applications) if n[:1].isupper())
        import difflib

        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UserError(f"unknown Keras application {name!r}{hint}")
    return lambda: factory(weights=None)


def _from_file(keras, path: Path, allow_custom_objects: bool, policy: str | None):
    config = read_keras_file(path, allow_custom_objects)
    compile_config = config.get("compile_config") or {}
    if policy is not None:
        config = _set_policies(config, policy)

    def build():
        model = keras.saving.deserialize_keras_object(config, safe_mode=True)
        optimizer = compile_config.get("optimizer")
        if optimizer is not None:
            model._vramplan_optimizer = keras.optimizers.deserialize(optimizer)
        model._vramplan_loss = compile_config.get("loss")
        model._vramplan_jit_compile = compile_config.get("jit_compile", "auto")
        return model

    return build


def _from_factory(spec: str):
    from vramplan.sources.user_code import load_factory

    return load_factory(spec)


def _variable_links(model) -> list[tuple[Any, dict, str]]:
    """Each Keras variable with the module slot (a ``_parameters`` or ``_buffers`` dict and
    its key) that holds its tensor: the tracer replaces the slots' tensors by fake ones, and
    the variables are pointed at them. Variables that are not weights (the random seed
    state of dropout layers) move to buffers, so that the parameter count is Keras's own
    ``count_params()``."""
    weights = {id(w._value) for w in model.weights}
    states: dict[int, torch.Tensor] = {}
    slots: dict[int, tuple[dict, str]] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in weights:
                slots.setdefault(id(param), (module._parameters, key))
                continue
            state = states.setdefault(id(param), param.detach())
            del module._parameters[key]
            module._buffers[key] = state
            slots.setdefault(id(param), (module._buffers, key))
    links = []
    for variable in model.variables:
        slot = slots.get(id(variable._value))
        if slot is not None:
            links.append((variable, *slot))
    return links


@contextlib.contextmanager
def _unseeded_random() -> Iterator[None]:
    """Keras's torch backend seeds each random op (dropout) from the integer value of a
    seed variable, which fake tensors do not have: while tracing, random ops draw from
    torch's default generator instead (the same shapes and dtypes)."""
    from keras.src.backend.torch import random

    seeded = random.torch_seed_generator
    random.torch_seed_generator = lambda seed: None
    try:
        yield
    finally:
        random.torch_seed_generator = seeded


@contextlib.contextmanager
def _traced_conditions() -> Iterator[None]:
    """``keras.ops.cond`` on the torch backend branches on the predicate's value, which a
    fake tensor does not have: while tracing, such a predicate is taken as true, Keras's
    own rule for symbolic execution (keras/src/backend/torch/core.py ``cond``). For a
    ``LossScaleOptimizer`` that is the step with finite gradients (the inner update runs)
    and its counter's upscale branch (scalar updates either way); real tensors branch as
    Keras does."""
    from keras.src.backend.torch import core
    from torch._subclasses.fake_tensor import is_fake

    branching = core.cond

    def cond(pred, true_fn, false_fn):
        if isinstance(pred, torch.Tensor) and is_fake(pred):
            return true_fn()
        return branching(pred, true_fn, false_fn)

    core.cond = cond
    try:
        yield
    finally:
        core.cond = branching


def scales_loss(model) -> bool:
    """Whether ``model.fit`` scales the loss with a ``LossScaleOptimizer``: the optimizer a
    compiled model holds is one, or (a model not compiled in memory, or read from a file
    whose compile config ``model.compile`` replays) the model's dtype policy is
    ``mixed_float16``, under which ``model.compile`` wraps the optimizer in one
    (``auto_scale_loss=True``, keras/src/trainers/trainer.py ``compile``).

    >>> from types import SimpleNamespace as Model
    >>> mixed = Model(name="mixed_float16")
    >>> scales_loss(Model(optimizer=None, dtype_policy=mixed))
    True
    >>> scales_loss(Model(optimizer=Model(), dtype_policy=mixed))  # compiled: not wrapped
    False
    """
    compiled = getattr(model, "optimizer", None)
    if compiled is not None:
        return type(compiled).__name__ == "LossScaleOptimizer"
    return model.dtype_policy.name == "mixed_float16"


def _materialize_constants(model) -> None:
    """Tensors a layer computed at build time and keeps outside its variables (the
    Normalization layer's mean and variance cast to the compute dtype) live on the meta
    device: give them a storage (fake, while tracing)."""
    for layer in _all_layers(model):
        for name, value in list(vars(layer).items()):
            if (
                isinstance(value, torch.Tensor)
                and not isinstance(value, nn.Parameter)
                and value.device.type == "meta"
            ):
                layer.__dict__[name] = torch.empty(value.shape, dtype=value.dtype)


def _input_shape(model, recipe: Recipe) -> tuple[int, ...]:
    if recipe.input_shape is not None:
        return recipe.input_shape
    inputs = getattr(model, "inputs", None) or []
    if len(inputs) != 1:
        raise UserError(
            "cannot read this Keras model's input shape: pass --input-shape (one sample, "
            "without the batch, channels last as Keras takes it, e.g. 224x224x3)"
        )
    shape = tuple(inputs[0].shape[1:])
    if any(d is None for d in shape):
        raise UserError(
            f"this Keras model's input has free sizes {shape}: pass --input-shape "
            "(one sample, without the batch, e.g. 224x224x3)"
        )
    return shape


def _loss(keras, model):
    """The compiled loss (``model.compile`` or the file's compile config), else sparse
    categorical cross-entropy for a (batch, classes) output and mean squared error
    otherwise; returns the loss and whether its targets are class indices."""
    loss = getattr(model, "_vramplan_loss", None) or getattr(model, "loss", None)
    if isinstance(loss, (list, dict)):
        raise UserError("a Keras model with several losses is not supported yet")
    if loss is not None:
        try:
            loss = keras.losses.get(loss)
        except (ValueError, TypeError) as exc:
            raise UserError(f"cannot read the compiled Keras loss {loss!r}: {exc}") from None
    name = getattr(loss, "name", None) or getattr(loss, "__name__", "")
    return loss, "sparse" in str(name)


def build_keras(rest: str, recipe: Recipe, allow_custom_objects: bool = False) -> BuiltModel:
    """A Keras model (``rest`` after ``keras:``) built on the meta device under the
    recipe's dtype policy, as a ``BuiltModel`` the tracer steps as ``model.fit`` does."""
    keras = import_keras()
    policy = policy_for(recipe.precision)
    if rest.endswith(".keras"):
        build = _from_file(keras, Path(rest).expanduser(), allow_custom_objects, policy)
    elif ":" in rest:
        build = _from_factory(rest)
    else:
        build = _application(keras, rest)
    try:
        model = KerasBuild(keras, policy)(build)
    except UserError:
        raise
    except Exception as exc:  # the user's architecture or factory failed to build
        text = " ".join(str(exc).split())[:300]
        raise UserError(f"building keras:{rest} failed: {type(exc).__name__}: {text}") from None
    if not isinstance(model, keras.Model):
        raise UserError(f"keras:{rest} did not give a keras.Model (got {type(model).__name__})")
    return keras_source(keras, model, recipe, f"keras:{rest}")


def _jit_compile(model) -> bool | str | None:
    """The ``jit_compile`` the user gave ``model.compile`` (a file's compile config keeps
    it, ``"auto"`` included; a model compiled here has it resolved for the torch backend,
    where ``"auto"`` is eager); None: not compiled."""
    if hasattr(model, "_vramplan_jit_compile"):
        return model._vramplan_jit_compile
    return getattr(model, "_jit_compile", None)


def _all_layers(model) -> list:
    """Every Keras layer of ``model``, nested ones too (a functional model's layers are not
    torch submodules)."""
    return list(model._flatten_layers(include_self=True, recursive=True))


def _conv_layers(model) -> list:
    return [
        layer
        for layer in _all_layers(model)
        if type(layer).__name__.startswith(("Conv", "DepthwiseConv", "SeparableConv"))
    ]


def keras_source(keras, model, recipe: Recipe, name: str) -> BuiltModel:
    """Wrap a meta-device Keras model as a ``BuiltModel``."""
    shape = _input_shape(model, recipe)
    links = _variable_links(model)
    loss_fn, sparse = _loss(keras, model)
    compiled = getattr(model, "_vramplan_optimizer", None) or getattr(model, "optimizer", None)
    inputs = getattr(model, "inputs", None) or []
    dtype_name = keras.backend.standardize_dtype(inputs[0].dtype) if inputs else ""
    layers = getattr(model, "layers", None) or [None]
    integer_input = dtype_name.startswith(("int", "uint")) or isinstance(
        layers[0], keras.layers.Embedding
    )

    def make_batch(batch_size: int, dtype: torch.dtype) -> Batch:
        if integer_input:
            inputs = torch.randint(0, 2, (batch_size, *shape))
        else:
            inputs = torch.randn(batch_size, *shape)
        return inputs

    loss_scaled = scales_loss(model)
    stepping: list[KerasOptimizer] = []  # the optimizer made for the step, once made

    def run(module: nn.Module, batch: Batch, training: bool) -> Any:
        for variable, slot, key in links:  # the tracer swapped the tensors: follow them
            variable._value = slot[key]
        _materialize_constants(module)
        # Keras casts by its own dtype policy; torch's autocast stays out of the step.
        with keras.device("cpu"), torch.autocast("cpu", enabled=False), _unseeded_random():
            output = module(batch, training=training)
            if not training:
                return output
            value = loss_of(output[0] if isinstance(output, (list, tuple)) else output)
            if stepping:  # model.fit's train_step: loss = self.optimizer.scale_loss(loss)
                value = stepping[-1].keras_optimizer.scale_loss(value)
            return value

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        if loss_fn is None and logits.dim() == 2 and logits.shape[-1] > 1:
            targets = torch.randint(0, logits.shape[-1], logits.shape[:-1])
            return keras.losses.sparse_categorical_crossentropy(targets, logits).mean()
        if loss_fn is None:
            return keras.losses.mean_squared_error(torch.zeros_like(logits), logits).mean()
        if sparse:
            targets = torch.randint(0, logits.shape[-1], logits.shape[:-1])
        else:
            targets = torch.zeros_like(logits, dtype=torch.float32)
        value = loss_fn(targets, logits)
        return value.mean() if value.dim() else value

    notes = [
        f"Keras {keras.__version__} traced on its torch backend (the step model.fit runs: "
        "forward, loss, backward, optimizer update); TensorFlow's own kernels are not traced"
    ]
    policy = policy_for(recipe.precision)
    if policy is not None:
        notes.append(
            f"Keras dtype policy {policy}"
            + (": fp32 variables, half-precision compute" if policy.startswith("mixed") else "")
        )
    wanted = keras_optimizer_name(compiled)
    if recipe.is_training and compiled is not None and wanted != recipe.optimizer:
        hint = f"pass --optimizer {wanted}" if wanted else "no vramplan optimizer matches it"
        chosen = type(compiled).__name__
        if hasattr(compiled, "inner_optimizer"):
            chosen += f"({type(compiled.inner_optimizer).__name__})"
        notes.append(
            f"model.compile chose {chosen}; this estimate used --optimizer "
            f"{recipe.optimizer} ({hint})"
        )
    if isinstance(model, keras.Model) and type(model).__name__ in ("Functional", "Sequential"):
        notes.append(
            "Keras's functional graph keeps every layer's output until the forward pass "
            "returns (keras/src/ops/function.py _run_through_graph); the trace includes them"
        )
    if any(getattr(layer, "data_format", "") == "channels_last" for layer in _conv_layers(model)):
        notes.append(
            "channels-last convolutions: the torch backend transposes each one's input and "
            "output to channels-first, and the trace counts those copies"
        )
    if _jit_compile(model) is True:
        notes.append(
            "jit_compile=True: on Keras's torch backend model.fit runs the step under "
            "torch.compile with inductor (keras/src/backend/torch/trainer.py); the trace is "
            "the eager step, and inductor's fused kernels (fewer intermediate tensors) are "
            "not modelled"
        )

    def make_optimizer(params: list[nn.Parameter], recipe: Recipe) -> KerasOptimizer | None:
        if recipe.optimizer not in KERAS_OPTIMIZERS:
            return None  # vramplan's own (8-bit, paged, ...): no Keras optimizer has it
        inner = getattr(compiled, "inner_optimizer", compiled)
        if inner is not None and wanted == recipe.optimizer:
            keras_optimizer = _fresh_optimizer(keras, inner)
        else:
            class_name, arguments = KERAS_OPTIMIZERS[recipe.optimizer]
            keras_optimizer = getattr(keras.optimizers, class_name)(**arguments)
        if loss_scaled:
            scaling = {"initial_scale": 2.0**15, "dynamic_growth_steps": 2000}
            scaling = {k: getattr(compiled, k, v) for k, v in scaling.items()}
            keras_optimizer = keras.optimizers.LossScaleOptimizer(keras_optimizer, **scaling)
        stepping[:] = [KerasOptimizer(keras, keras_optimizer, model, params)]
        return stepping[0]

    if recipe.is_training and recipe.optimizer in KERAS_OPTIMIZERS:
        notes.append(
            "the optimizer step is Keras's own (keras.optimizers on the torch backend: its "
            "variables and its foreach update's temporaries)"
        )
    if recipe.is_training and loss_scaled and recipe.optimizer in KERAS_OPTIMIZERS:
        notes.append(
            "loss scaling traced: model.compile wraps the optimizer in a LossScaleOptimizer "
            "under mixed_float16, which scales the loss, checks every gradient for inf/NaN "
            "and divides each by the scale into a copy (all copies alive through the inner "
            "optimizer's update)"
        )
    return BuiltModel(
        name=name,
        architecture=type(model).__name__,
        kind="keras",
        model=model,
        make_batch=make_batch,
        run=run,
        default_input_shape=shape,
        notes=notes,
        repeat_blocks=False,
        input_hint="check --input-shape (one sample, channels last as Keras takes it)",
        zero_grad_after_forward=True,
        make_optimizer=make_optimizer,
    )
