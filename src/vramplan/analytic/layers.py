"""``vramplan layers spec.yaml``: a table of layers from a paper, walked like CS231n's VGG.

A spec is YAML or JSON: an ``input`` shape for one sample and a list of ``layers``, each a
type name alone or a one-key mapping of type to settings::

    input: [3, 224, 224]
    layers:
      - conv: {out: 64, kernel: 3, padding: 1, activation: relu}
      - pool: {kernel: 2}
      - dense: {out: 10}

Shapes propagate layer by layer; each row counts parameters and output values. The
default method counts what PyTorch keeps for backward (which tensors each layer type
saves); ``cs231n`` reproduces the course's recipe.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from vramplan.analytic.calc import activation_bytes, cs231n_bytes
from vramplan.analytic.states import model_state_bytes
from vramplan.errors import UserError
from vramplan.recipe import Recipe
from vramplan.result import Component, Estimate, ModelInfo, Peak, Phase, empty_components

TYPES = (
    "input",
    "conv",
    "pool",
    "maxpool",
    "avgpool",
    "batchnorm",
    "relu",
    "gelu",
    "dropout",
    "dense",
    "linear",
    "flatten",
    "embedding",
    "attention",
    "layernorm",
)


@dataclass(frozen=True)
class LayerRow:
    """One layer after shape propagation."""

    index: int
    kind: str
    shape: tuple[int, ...]
    parameters: int
    values: int
    saved_bytes: int
    """Bytes per sample this layer adds to what PyTorch keeps for backward."""

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "type": self.kind,
            "output_shape": list(self.shape),
            "parameters": self.parameters,
            "activation_values": self.values,
            "saved_bytes_per_sample": self.saved_bytes,
        }


def load_spec(path: str) -> dict:
    """Read a YAML or JSON spec file (a UserError for anything malformed)."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"layer spec not found: {path}")
    if file.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise UserError(f"layer spec {path}: give a .yaml, .yml or .json file")
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read layer spec {path}: {exc}") from None
    try:
        if file.suffix == ".json":
            spec = json.loads(text)
        else:
            import yaml

            spec = yaml.safe_load(text)
    except Exception as exc:  # json and yaml raise their own error types
        raise UserError(f"malformed layer spec {path}: {str(exc).splitlines()[0]}") from None
    if (
        not isinstance(spec, dict)
        or "input" not in spec
        or not isinstance(spec.get("layers"), list)
    ):
        raise UserError(f"layer spec {path} needs an 'input' shape and a list of 'layers'")
    return spec


def _settings(entry) -> tuple[str, dict]:
    if isinstance(entry, str):
        return entry.lower(), {}
    if isinstance(entry, dict) and len(entry) == 1:
        kind, settings = next(iter(entry.items()))
        if settings is None or isinstance(settings, dict):
            return str(kind).lower(), dict(settings or {})
    raise UserError(f"cannot read layer {entry!r}: use a type name or {{type: {{settings}}}}")


def _int(settings: dict, key: str, default: int | None, kind: str) -> int:
    value = settings.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < 0
        or (value == 0 and key in ("out", "kernel"))
    ):
        raise UserError(f"{kind} layer needs a positive integer '{key}', got {value!r}")
    return value


def _propagate(
    kind: str, s: dict, shape: tuple[int, ...], act: int, index: int
) -> tuple[tuple[int, ...], int, int]:
    """(output shape, parameters, saved bytes per sample) of one layer."""
    where = f"layer {index} ({kind})"
    if kind == "conv":
        if len(shape) != 3:
            raise UserError(f"{where} needs a CxHxW input, got {shape}")
        c, h, w = shape
        k = _int(s, "kernel", 3, kind)
        stride, pad = _int(s, "stride", 1, kind), _int(s, "padding", k // 2, kind)
        out = _int(s, "out", None, kind)
        oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        if oh <= 0 or ow <= 0:
            raise UserError(f"{where}: kernel {k} does not fit a {h}x{w} input")
        params = k * k * c * out + (out if s.get("bias", True) else 0)
        # conv saves its input; a fused ReLU saves its output (the next layer's input)
        saved = math.prod(shape) * act
        return (out, oh, ow), params, saved
    if kind in ("pool", "maxpool", "avgpool"):
        if len(shape) != 3:
            raise UserError(f"{where} needs a CxHxW input, got {shape}")
        c, h, w = shape
        k = _int(s, "kernel", 2, kind)
        stride = _int(s, "stride", k, kind)
        oh, ow = (h - k) // stride + 1, (w - k) // stride + 1
        if oh <= 0 or ow <= 0:
            raise UserError(f"{where}: kernel {k} does not fit a {h}x{w} input")
        indices = c * oh * ow * 8 if kind != "avgpool" else 0  # int64 argmax indices
        return (c, oh, ow), 0, math.prod(shape) * act + indices
    if kind == "batchnorm":
        return shape, 2 * shape[0], math.prod(shape) * act + 8 * shape[0]
    if kind in ("relu", "gelu"):
        return shape, 0, math.prod(shape) * act
    if kind == "dropout":
        return shape, 0, math.prod(shape)  # a 1-byte mask
    if kind == "flatten":
        return (math.prod(shape),), 0, 0
    if kind in ("dense", "linear"):
        features = shape[-1] if len(shape) == 2 else math.prod(shape)
        out = _int(s, "out", None, kind)
        lead = shape[:-1] if len(shape) == 2 else ()
        return (*lead, out), features * out + out, math.prod(shape) * act
    if kind == "embedding":
        if len(shape) != 1:
            raise UserError(f"{where} needs token ids of shape (S,), got {shape}")
        vocab, dim = _int(s, "vocab", None, kind), _int(s, "dim", None, kind)
        return (shape[0], dim), vocab * dim, shape[0] * 8
    if kind in ("attention", "layernorm"):
        if len(shape) != 2:
            raise UserError(f"{where} needs a (S, D) input, got {shape}")
        seq, dim = shape
        if kind == "layernorm":
            return shape, 2 * dim, seq * dim * act + 8 * seq
        heads = _int(s, "heads", 1, kind)
        if dim % heads:
            raise UserError(f"{where}: {heads} heads do not divide width {dim}")
        # q, k, v, o projections with bias; saved: input, q, k, v, probabilities, context
        saved = (5 * seq * dim + heads * seq * seq) * act
        return shape, 4 * dim * dim + 4 * dim, saved
    raise UserError(f"unknown layer type {kind!r} in layer {index}; known: {', '.join(TYPES)}")


def walk(spec: dict, recipe: Recipe) -> list[LayerRow]:
    """Propagate shapes through the spec; row 0 is the input."""
    shape = spec["input"]
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    ):
        raise UserError(f"spec input must be a list of positive integers, got {shape!r}")
    shape = tuple(shape)
    act = activation_bytes(recipe.precision)
    rows = [LayerRow(0, "input", shape, 0, math.prod(shape), 0)]
    for index, entry in enumerate(spec["layers"], start=1):
        kind, settings = _settings(entry)
        shape, params, saved = _propagate(kind, settings, shape, act, index)
        fused = settings.get("activation") if kind in ("conv", "dense", "linear") else None
        if fused not in (None, "relu", "gelu"):
            raise UserError(f"layer {index}: unknown fused activation {fused!r}")
        if fused:
            saved += math.prod(shape) * act
        rows.append(LayerRow(index, kind, shape, params, math.prod(shape), saved))
    return rows


def layers_estimate(
    spec: dict, recipe: Recipe, method: str = "pytorch", name: str = "layers"
) -> Estimate:
    """An Estimate from a layer spec by the PyTorch or the CS231n method."""
    rows = walk(spec, recipe)
    params = sum(r.parameters for r in rows)
    # CS231n counts every layer's output except in-place activations and dropout
    counted = [r for r in rows[1:] if r.kind not in ("relu", "gelu", "dropout", "flatten")]
    values = sum(r.values for r in counted) + rows[0].values
    batch = recipe.batch_size
    components = empty_components()
    if method == "cs231n":
        components.update(cs231n_bytes(params, values - rows[0].values, rows[0].values, batch))
    else:
        act = activation_bytes(recipe.precision)
        components.update(
            model_state_bytes(
                params, recipe.precision, recipe.optimizer, training=recipe.is_training
            )
        )
        if recipe.is_training:
            components[Component.ACTIVATIONS] = batch * sum(r.saved_bytes for r in rows)
            # backward holds an output gradient and an input gradient at a time
            largest = max(r.values for r in rows)
            components[Component.TEMPORARIES] = 2 * largest * batch * act
        else:
            largest = max(a.values + b.values for a, b in zip(rows, rows[1:], strict=False))
            components[Component.ACTIVATIONS] = largest * batch * act
        components[Component.INPUTS] = rows[0].values * batch * act
    info = ModelInfo(
        name=name,
        parameters=params,
        trainable_parameters=params,
        parameter_bytes=components[Component.PARAMETERS],
        kind="layers",
    )
    note = (
        "CS231n recipe: activations x2 x batch, parameters x3, plus the input batch"
        if method == "cs231n"
        else "PyTorch method: each layer's saved tensors (conv/linear inputs, ReLU outputs, pool "
        "indices, dropout masks), gradients and optimizer state by recipe, and one pair of "
        "activation gradients at a time; CS231n instead doubles every activation and "
        "triples the parameters"
    )
    return Estimate(
        model=info,
        recipe=recipe,
        peak=Peak(allocated_bytes=sum(components.values()), phase=Phase.BACKWARD),
        components=components,
        method="layers",
        notes=(note,),
        details={
            "method": method,
            "layers": [r.to_json() for r in rows],
            "activation_values_per_sample": values,
        },
    )
