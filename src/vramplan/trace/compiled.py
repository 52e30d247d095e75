"""``torch.compile``'s effect on training memory: regions run as AOTAutograd runs them.

``torch.compile`` with Inductor hands each captured graph to AOTAutograd, which traces the
joint forward-backward graph and splits it with the min-cut rematerialization partitioner
(``torch/_functorch/partitioners.py``, ``min_cut_rematerialization_partition``): compute-
heavy results (matmuls, attention) are saved for backward, cheap pointwise chains (RMSNorm's
fp32 arithmetic, SiLU, rotary, the cross-entropy's upcast) are recomputed in backward
instead of saved.

A ``CompiledRegion`` runs PyTorch's own machinery on the traced step's fake tensors:
``aot_function`` with Inductor's decomposition table and that partitioner, as Inductor's
``compile_fx`` calls them; the forward and backward graphs then run op by op under the
recorder, so what is saved for backward is exactly the partitioner's choice and each value
is freed at its last use.

What Inductor adds beyond the partition — fusing pointwise chains into one kernel, so their
intermediates never exist — is a stated rule (``fused_intermediates``): a pointwise, view
or inlined result read only by kernels that load it inline is not recorded. Checked
against Inductor compiling for the CPU (``tests/test_compile.py``)::

    layer.forward = CompiledRegion(layer.forward, layer)
    out = layer(x)            # first call captures and partitions the graph (paused recorder)
    out.sum().backward()      # backward runs the partitioned backward graph
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten, tree_unflatten

from vramplan.sources.blocks import true_repeated_blocks
from vramplan.trace.recorder import AllocationRecorder


@contextlib.contextmanager
def _saved_tensor_hooks_suspended() -> Iterator[None]:
    """Pop the saved-tensor hooks in force (checkpointing's, offloading's) while a graph is
    captured, so they pack nothing of the capture; push them back after."""
    hooks = []
    while (top := torch._C._autograd._top_saved_tensors_default_hooks(True)) is not None:
        hooks.append(top)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(hooks):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


@contextlib.contextmanager
def _recorders_paused() -> Iterator[None]:
    """Pause every ``AllocationRecorder`` on the dispatch-mode stack: capturing a graph is
    not part of the step."""
    recorders = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, AllocationRecorder)]
    with contextlib.ExitStack() as stack:
        for recorder in recorders:
            stack.enter_context(recorder.paused())
        yield


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor like ``tensor`` that the capture's own run may keep alive (its autograd
    graph dies whenever the garbage collector gets to it) without holding the step's."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and not _is_fake(tensor):
        return tensor.detach()
    copy = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype)
    return copy.requires_grad_(tensor.requires_grad)


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


def _plain_attributes(module: nn.Module | None) -> tuple:
    """What, besides shapes, can make two instances of a block class trace differently:
    their scalar attributes (a layer's index excepted: training never reads a cache)."""
    if module is None:
        return ()
    found = []
    for name, sub in module.named_modules():
        for key, value in sorted(vars(sub).items()):
            if key.startswith("_") or key.endswith("layer_idx"):
                continue
            if value is None or isinstance(value, (bool, int, float, str)):
                found.append((name, key, value))
    return (type(module).__qualname__, tuple(found))


def _tensor_key(tensor: torch.Tensor) -> tuple:
    return (
        type(tensor).__name__,
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.requires_grad,
    )


aten = torch.ops.aten
MAX_POINTWISE_CAT_INPUTS = 8
"""Inductor lowers a ``cat`` of at most this many inputs as a pointwise kernel
(``torch/_inductor/config.py``, ``max_pointwise_cat_inputs``)."""
_INLINED = {
    aten.cat.default,
    aten.gather.default,
    aten.full.default,
    aten.scalar_tensor.default,
    torch.ops.prims.iota.default,
}
"""Ops Inductor lowers as loads inside its consumers' kernels (``torch/_inductor/
lowering.py``): pointwise cat, gather's indirect load, constants and index ranges."""


def _op(node: torch.fx.Node):
    return node.target if isinstance(node.target, torch._ops.OpOverload) else None


def _is_view(node: torch.fx.Node) -> bool:
    op = _op(node)
    return op is not None and op.is_view


def _fuses_into_consumers(node: torch.fx.Node) -> bool:
    """A pointwise op, a view, or an op Inductor inlines: its result can live in registers
    of the kernel that reads it."""
    op = _op(node)
    if op is None:
        return False
    if op is aten.cat.default and len(node.args[0]) > MAX_POINTWISE_CAT_INPUTS:
        return False
    return torch.Tag.pointwise in op.tags or op.is_view or op in _INLINED


def _reads_inline(node: torch.fx.Node) -> bool:
    """Whether ``node``'s kernel reads its inputs through loaders (pointwise ops, views,
    reductions, inlined ops) rather than as materialized buffers (matmuls, attention)."""
    op = _op(node)
    return op is not None and (_fuses_into_consumers(node) or torch.Tag.reduction in op.tags)


def fused_intermediates(graph: torch.fx.Graph) -> set[str]:
    """The nodes whose results Inductor never materializes: pointwise-like results read
    only by kernels that load them inline, and returned or saved by nobody.

    A clearly stated rule, not Inductor's scheduler: a result is materialized when it is a
    graph output or an input of an op that is not fused (an extern kernel such as ``mm``
    or flash attention), through any chain of views; every other pointwise, view or
    inlined result is fused into its consumers. (Inductor may also materialize a result
    read by several kernels; those are not modelled.)
    """
    needed: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output" or (node.op == "call_function" and not _reads_inline(node)):
            needed.update(_input_nodes(node))
    stack = list(needed)
    while stack:
        node = stack.pop()
        if _is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node):
            base = node.args[0]
            if base not in needed:
                needed.add(base)
                stack.append(base)
    return {
        node.name
        for node in graph.nodes
        if node.op == "call_function" and _fuses_into_consumers(node) and node not in needed
    }


def _input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


class _FusedRun(torch.fx.Interpreter):
    """Runs a partitioned graph op by op, recording nothing of the results Inductor fuses
    away; each value is freed at its last use, the inputs as soon as they are read for
    the last time (the boxed calling convention AOTAutograd uses)."""

    def __init__(self, module: torch.fx.GraphModule, fused: set[str]) -> None:
        super().__init__(module)
        self.fused = fused

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.name in self.fused:
            with _recorders_paused():
                return super().run_node(n)
        return super().run_node(n)


def _inductor_like(module: torch.fx.GraphModule, example_inputs) -> Callable:
    """An ``aot_function`` compiler: the graph run with Inductor's fused results unrecorded."""
    fused = fused_intermediates(module.graph)

    def run(args: list) -> Any:
        return _FusedRun(module, fused).boxed_run(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def partitioned_compiler() -> dict:
    """``aot_function``'s arguments as Inductor chooses them (``torch/_inductor/
    compile_fx.py``): Inductor's decompositions and Inductor's own ``partition_fn`` (its
    joint-graph passes, such as turning the cross-entropy backward's scatter into a
    pointwise ``where``, then the min-cut partitioner); the graphs then run by
    ``_inductor_like``."""
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    return {
        "fw_compiler": _inductor_like,
        "bw_compiler": _inductor_like,
        "partition_fn": partition_fn,
        "decompositions": select_decomp_table(),
    }


class CompiledRegion:
    """``forward`` (a module's, or a plain function) run as ``torch.compile`` runs it in
    training: one ``aot_function`` per distinct call signature, shared by every instance of
    the same block class with the same settings."""

    _shared: dict[tuple, Callable] = {}

    def __init__(
        self,
        forward: Callable,
        module: nn.Module | None = None,
    ) -> None:
        self.forward = forward
        self.module = module
        self._attributes = _plain_attributes(module)
        functools.update_wrapper(self, forward)

    def _state(self) -> tuple[list[str], list[torch.Tensor]]:
        if self.module is None:
            return [], []
        named = [
            *self.module.named_parameters(remove_duplicate=False),
            *self.module.named_buffers(remove_duplicate=False),
        ]
        return [name for name, _ in named], [tensor for _, tensor in named]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)  # inference: only the fusion would differ
        leaves, spec = tree_flatten((args, kwargs))
        names, state = self._state()
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in slots]
        constants = tuple(
            (i, leaf if isinstance(leaf, (bool, int, float, str, type(None))) else id(leaf))
            for i, leaf in enumerate(leaves)
            if not isinstance(leaf, torch.Tensor)
        )
        key = (
            self._attributes or id(self.forward),
            spec,
            constants,
            tuple(names),
            tuple(_tensor_key(t) for t in (*state, *tensors)),
            torch.is_autocast_enabled(),
        )
        compiled = self._shared.get(key)
        if compiled is None:
            constant_leaves = [None if i in slots else leaf for i, leaf in enumerate(leaves)]
            compiled = self._build(constant_leaves, spec, slots, names)
            with _recorders_paused(), _saved_tensor_hooks_suspended():
                compiled(*state, *map(_stand_in, tensors))  # captures; not the step's run
            self._shared[key] = compiled
        return compiled(*state, *tensors)

    def _build(self, leaves: list, spec, slots: list[int], names: list[str]) -> Callable:
        from torch._functorch.aot_autograd import aot_function

        forward, module = self.forward, self.module
        outputs: dict[str, Any] = {}

        def flat(*primals: torch.Tensor) -> tuple[torch.Tensor, ...]:
            state, tensors = primals[: len(names)], primals[len(names) :]
            filled = list(leaves)
            for slot, tensor in zip(slots, tensors, strict=True):
                filled[slot] = tensor
            args, kwargs = tree_unflatten(filled, spec)
            context = (
                torch.nn.utils.stateless._reparametrize_module(
                    module, dict(zip(names, state, strict=True))
                )
                if module is not None
                else contextlib.nullcontext()
            )
            with context:
                result = forward(*args, **kwargs)
            out_leaves, out_spec = tree_flatten(result)
            tensor = [isinstance(leaf, torch.Tensor) for leaf in out_leaves]
            outputs["spec"], outputs["tensor"] = out_spec, tensor
            outputs["leaves"] = [
                None if t else leaf for t, leaf in zip(tensor, out_leaves, strict=True)
            ]
            return tuple(leaf for t, leaf in zip(tensor, out_leaves, strict=True) if t)

        run = aot_function(flat, **partitioned_compiler())

        def call(*primals: torch.Tensor) -> Any:
            results = iter(run(*primals))
            filled = [
                next(results) if tensor else leaf
                for tensor, leaf in zip(outputs["tensor"], outputs["leaves"], strict=True)
            ]
            return tree_unflatten(filled, outputs["spec"])

        return call


def compile_blocks(model: nn.Module) -> int:
    """Compile each repeated block as torchtune's ``compile_model`` does (every
    ``TransformerSelfAttentionLayer``, ``m.compile()``); return how many. Apply before
    checkpointing, which wraps the compiled block as torchtune's ``checkpoint_wrapper``
    does. A Hugging Face model stops making its KV cache: a compiled region does not
    replay Python side effects such as ``DynamicCache.update``, and training never reads
    the cache (torchtune's decoder has none in training)."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
    blocks = true_repeated_blocks(model)
    for block in blocks:
        raw = getattr(type(block).forward, "__wrapped__", None)
        if raw is not None and hasattr(block, "gradient_checkpointing"):
            block.forward = functools.partial(
                _checkpoint_outside, block, CompiledRegion(raw.__get__(block), block)
            )
        else:
            block.forward = CompiledRegion(block.forward, block)
    return len(blocks)


def _checkpoint_outside(block: nn.Module, region: CompiledRegion, *args, **kwargs) -> Any:
    """transformers >= 5 checkpoints inside the layer class's ``forward``
    (``GradientCheckpointingLayer.__init_subclass__``); compiled, the checkpoint must wrap
    the compiled region, as torchtune's ``checkpoint_wrapper`` wraps a compiled layer."""
    if block.gradient_checkpointing and block.training:
        return block._gradient_checkpointing_func(functools.partial(region, **kwargs), *args)
    return region(*args, **kwargs)


def compile_note(blocks: int, recipe) -> str:
    """What ``--compile`` traced, for the estimate's notes."""
    loss = (
        "and the per-chunk cross-entropy (torchtune's compile_loss)"
        if recipe.loss_chunks
        else "(the loss outside them runs eagerly)"
    )
    return (
        f"torch.compile: {blocks} repeated blocks {loss} traced as AOTAutograd's min-cut "
        "partition (Inductor's decompositions): pointwise chains recomputed in backward, "
        "not saved; pointwise results read only by fused kernels never allocated"
    )
