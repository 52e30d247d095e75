"""DNNMem's approach on TensorFlow's own graph: the Keras train step as a ``tf.function``
concrete function with static shapes, every op's output bytes, and a liveness schedule in
the graph's op order (an output lives from its op until its last consumer); the peak of
live bytes plus the variables (weights and Adam's moments) (prints only).

Needs TensorFlow, which vramplan does not depend on; run it in an environment that has
it (``pip install tensorflow-cpu keras``), without vramplan:

KERAS_BACKEND=tensorflow python benchmarks/keras_tf_graph.py
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

B, C, V, D, HEADS, HEAD_DIM, FF, T = 16, 10, 1000, 64, 4, 16, 128, 64


def cnn():
    x = keras.Input((32, 32, 3))
    h = x
    for width in (32, 64):
        h = keras.layers.Conv2D(width, 3, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(x, keras.layers.Dense(C)(h))


def block(h):
    h = keras.layers.LayerNormalization()(
        h + keras.layers.MultiHeadAttention(HEADS, HEAD_DIM)(h, h)
    )
    f = keras.layers.Dense(D)(keras.layers.Dense(FF, activation="relu")(h))
    return keras.layers.LayerNormalization()(h + f)


def transformer():
    x = keras.Input((T,), dtype="int32")
    h = block(block(keras.layers.Embedding(V, D)(x)))
    return keras.Model(x, keras.layers.Dense(C)(keras.layers.GlobalAveragePooling1D()(h)))


ALIASES = {"ReadVariableOp", "Identity", "Reshape", "ExpandDims", "Squeeze", "StopGradient"}
"""Ops whose output shares its input's buffer in TensorFlow's runtime (a variable read
is the variable's own buffer; a reshape forwards its input)."""


def output_bytes(tensor) -> int:
    """Static bytes of one op output (0 for resources and aliases)."""
    if tensor.op.type in ALIASES:
        return 0
    if tensor.dtype in (tf.resource, tf.variant) or tensor.shape.rank is None:
        return 0
    dims = tensor.shape.as_list()
    if any(d is None for d in dims):
        if tensor.dtype.is_integer and len(dims) <= 1:
            return 0  # shape arithmetic of the gradient (BroadcastGradientArgs): host-side
        raise ValueError(f"{tensor.name} has a free size {dims}")
    return math.prod(dims) * tensor.dtype.size


def graph_peak(model, x_spec) -> tuple[int, int, int]:
    """(variables bytes, peak of live op outputs, number of ops) of one train step."""
    model.compile(optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        return model.train_step((x, y))

    graph = step.get_concrete_function(x_spec, tf.TensorSpec((B,), tf.int64)).graph
    order = {op: i for i, op in enumerate(graph.get_operations())}
    last_use: dict = {}
    for op in graph.get_operations():
        for tensor in op.inputs:
            last_use[tensor.ref()] = max(last_use.get(tensor.ref(), -1), order[op])
    frees: dict[int, int] = {}
    live = peak = 0
    for op in graph.get_operations():
        i = order[op]
        for tensor in op.outputs:
            size = output_bytes(tensor)
            live += size
            end = last_use.get(tensor.ref(), i)
            frees[end] = frees.get(end, 0) + size
        peak = max(peak, live)
        live -= frees.pop(i, 0)
    variables = sum(
        math.prod(v.shape) * tf.as_dtype(v.dtype).size
        for v in [*model.variables, *model.optimizer.variables]
    )
    return variables, peak, len(order)


def main() -> None:
    cases = [
        ("CNN, channels last", cnn, tf.TensorSpec((B, 32, 32, 3), tf.float32)),
        ("transformer, functional", transformer, tf.TensorSpec((B, T), tf.int32)),
    ]
    print(f"{'case':<26} {'variables':>11} {'op outputs':>11} {'total':>11} {'ops':>6}")
    for label, factory, spec in cases:
        variables, peak, ops = graph_peak(factory(), spec)
        print(f"{label:<26} {variables:>11,} {peak:>11,} {variables + peak:>11,} {ops:>6}")


if __name__ == "__main__":
    main()
