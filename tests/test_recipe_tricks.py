"""Recipe tricks of torchtune, bitsandbytes and Liger, traced. Ground truth: bitsandbytes'
own optimizer state on the CPU, real CPU runs with PyTorch's own hooks (post-accumulate-grad
hooks, saved-tensor hooks) and profiler, and exact arithmetic."""

from __future__ import annotations

import bisect
import contextlib
import inspect
import json
import re

import pytest
import torch
from conftest import TINY_LLAMA
from torch import nn

from vramplan import Recipe, UserError
from vramplan.device.options import device_options
from vramplan.measurement.run import measure_built
from vramplan.optimizers import Adam8bitModel
from vramplan.pipeline import trace_and_estimate
from vramplan.result import Component, Phase
from vramplan.sources import resolve
from vramplan.sources.loss import liger_chunk_size
from vramplan.sources.user_code import module_source
from vramplan.trace.tricks import MIN_OFFLOAD_BYTES, Offloader

BATCH, SEQ, VOCAB = 2, 64, TINY_LLAMA["vocab_size"]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 512, bias=False),
        nn.ReLU(),
        nn.Linear(512, 384, bias=False),
        nn.ReLU(),
        nn.Linear(384, 128, bias=False),
    )


def live_peak(trace, category: Component) -> int:
    """The most bytes of ``category`` alive at one event of the trace."""
    live = peak = 0
    for event in trace.events():
        if event.allocation.category == category:
            live += event.delta
            peak = max(peak, live)
    return peak


def traced_mlp(x: torch.Tensor, **knobs):
    recipe = Recipe(batch_size=x.shape[0], **knobs)
    return trace_and_estimate(module_source(mlp(), recipe, "mlp", example_batch=x), recipe, "cpu")


# -- paged and 8-bit AdamW ----------------------------------------------------------------

SHAPES = [(512, 512), (64,), (300, 400), (50, 50), (4096,)]


@pytest.mark.parametrize(
    "name,bits,paged",
    [("AdamW8bit", 8, False), ("PagedAdamW8bit", 8, True), ("PagedAdamW32bit", 32, True)],
)
def test_state_layout_equals_bitsandbytes(name, bits, paged):
    """Every state tensor bitsandbytes' own ``init_state`` makes on the CPU (uint8 states,
    fp32 absmax per 256 elements, the two shared 256-entry maps; fp32 under 4096 elements
    or at 32 bits) has the same name, shape and dtype in the model."""
    bnb = pytest.importorskip("bitsandbytes")
    params = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    reference = getattr(bnb.optim, name)(params)
    for index, param in enumerate(params):
        reference.init_state(reference.param_groups[0], param, 0, index)
    theirs = [
        {k: (v.shape, v.dtype) for k, v in reference.state[p].items() if torch.is_tensor(v)}
        for p in params
    ]
    mine = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for param in mine:
        param.grad = torch.zeros_like(param)
    model = Adam8bitModel(mine, bits=bits, paged=paged)
    model.step()
    assert [{k: (v.shape, v.dtype) for k, v in model.state[p].items()} for p in mine] == theirs


def test_paged_threshold_is_bitsandbytes_own():
    """bitsandbytes pages only states of parameters of 1e5+ elements (``get_state_buffer``)."""
    bnb = pytest.importorskip("bitsandbytes")
    source = inspect.getsource(bnb.optim.optimizer.Optimizer8bit.get_state_buffer)
    assert "p.numel() < 1e5" in source
    assert Adam8bitModel.min_paged_size == 100_000


def test_paged_state_leaves_the_card_for_host_ram():
    """The MLP's weights have 131,072, 196,608 and 49,152 elements: the first two page
    (two uint8 states each), the third does not; absmax and maps stay on the card."""
    x = torch.randn(2, 256)
    plain, _ = traced_mlp(x, optimizer="adam8bit")
    paged, trace = traced_mlp(x, optimizer="paged_adamw_8bit")
    paged_bytes = 2 * (131_072 + 196_608)
    assert trace.host_bytes == {"paged_optimizer_state": paged_bytes}
    assert paged.details["host_bytes"] == {"paged_optimizer_state": paged_bytes}
    state = plain.details["optimizer_state_bytes"]
    assert paged.details["optimizer_state_bytes"] == state - paged_bytes
    fp32, trace32 = traced_mlp(x, optimizer="paged_adamw_32bit")
    assert trace32.host_bytes == {"paged_optimizer_state": 8 * (131_072 + 196_608)}
    assert fp32.details["optimizer_state_bytes"] == 8 * 49_152


# -- optimizer step in backward -------------------------------------------------------------


def test_optimizer_in_backward_frees_each_gradient_as_real_hooks_do():
    """A real CPU run with the same hooks records the gradient bytes alive each time a hook
    fires; the trace's gradient peak is their maximum (one weight's), where the ordinary
    step keeps every gradient at once, and its allocated peak drops by at most the
    difference."""
    x = torch.randn(2, 256)
    normal, normal_trace = traced_mlp(x, optimizer="sgd")
    fused, fused_trace = traced_mlp(x, optimizer="sgd", optimizer_in_backward=True)

    model, seen = mlp(), []
    for param in model.parameters():
        optimizer = torch.optim.SGD([param], lr=1e-3)

        def hook(p, optimizer=optimizer):
            seen.append(sum(q.grad.nbytes for q in model.parameters() if q.grad is not None))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        param.register_post_accumulate_grad_hook(hook)
    model(x).sum().backward()
    every = sum(p.nbytes for p in model.parameters())
    assert live_peak(normal_trace, Component.GRADIENTS) == every
    assert live_peak(fused_trace, Component.GRADIENTS) == max(seen) < every
    drop = normal.peak.allocated_bytes - fused.peak.allocated_bytes
    assert 0 < drop <= every - max(seen)


def test_measure_steps_in_backward_for_real(tiny_llama):
    """``measure`` runs the per-parameter hooks too (it ran the ordinary step before): the
    real CPU peak (PyTorch's profiler) equals the trace's within 1% and sits below the
    measured peak of the ordinary step, whose gradients all live at once."""

    def traced_and_real(**knobs) -> tuple[int, int]:
        recipe = Recipe(batch_size=1, seq_len=8, optimizer="sgd", **knobs)  # gradients peak
        traced = trace_and_estimate(resolve(tiny_llama, recipe), recipe, "cpu")[0]
        real = measure_built(resolve(tiny_llama, recipe, "cpu"), recipe, "cpu", steps=2)
        return traced.peak.allocated_bytes, real.allocated_bytes

    _, plain = traced_and_real()
    traced, real = traced_and_real(optimizer_in_backward=True)
    assert abs(traced - real) <= 0.01 * real, (traced, real)
    assert real < plain


def test_optimizer_in_backward_keeps_the_state_of_every_parameter():
    x = torch.randn(2, 256)
    normal, _ = traced_mlp(x, optimizer="adamw")
    fused, _ = traced_mlp(x, optimizer="adamw", optimizer_in_backward=True)
    assert fused.details["optimizer_state_bytes"] == normal.details["optimizer_state_bytes"]


def test_optimizer_in_backward_refuses_accumulation():
    with pytest.raises(UserError, match="--grad-accum 1"):
        Recipe(optimizer_in_backward=True, grad_accum=2)


# -- activation offloading ------------------------------------------------------------------


def test_offloaded_bytes_equal_what_real_saved_tensor_hooks_see():
    """A real CPU run under ``saved_tensors_hooks`` sums the saved tensors torchtune moves
    (1024+ bytes, not ``nn.Parameter`` instances: the transposed weight views matmuls save
    are moved too, as torchtune's check lets them through); the trace reports exactly that
    in host RAM, and the card keeps fewer activations."""
    x = torch.randn(8, 256)
    _, plain = traced_mlp(x, optimizer="sgd")
    _, trace = traced_mlp(x, optimizer="sgd", activation_offload=True)

    moved = []

    def pack(t):
        if t.nbytes >= MIN_OFFLOAD_BYTES and not isinstance(t, nn.Parameter):
            moved.append(t.nbytes)
        return t

    recipe = Recipe(batch_size=8)
    real = module_source(mlp(), recipe, "mlp", example_batch=x, copy_to_meta=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = real.run(real.model, x, True)  # the same forward and loss as traced
    loss.backward()
    assert trace.host_bytes == {"offloaded_activations": sum(moved)} and moved
    kept = live_peak(trace, Component.ACTIVATIONS)
    assert kept < live_peak(plain, Component.ACTIVATIONS)


def test_measured_offload_moves_what_the_trace_moves_and_keeps_the_gradients():
    """A measured run's offloader (no recorder) copies the same saved tensors to host
    memory as the traced one reports, and brings them back: the gradients equal a run
    without offloading, to the last bits a matrix product's kernel may change with its
    inputs' addresses (a copy brought back sits elsewhere: on an AVX-512 host one
    element differed by 4e-7 of the largest)."""
    x = torch.randn(8, 256)
    _, trace = traced_mlp(x, optimizer="sgd", activation_offload=True)
    recipe = Recipe(batch_size=8)

    def gradients(offload: bool) -> tuple[list[torch.Tensor], int]:
        real = module_source(mlp(), recipe, "mlp", example_batch=x, copy_to_meta=False)
        offloader = Offloader(None, real.model)
        context = offloader.forward() if offload else contextlib.nullcontext()
        with context:
            loss = real.run(real.model, x, True)
        host = sum(t.nbytes for t, moved in offloader.tracker.values() if moved)
        loss.backward()
        return [p.grad for p in real.model.parameters()], host

    offloaded, host = gradients(True)
    plain, _ = gradients(False)
    assert host == trace.host_bytes["offloaded_activations"]
    assert all(
        torch.allclose(a, b, rtol=0, atol=1e-6 * b.abs().max().item())
        for a, b in zip(offloaded, plain, strict=True)
    )


def checkpointed_stack(blocks: int) -> nn.Module:
    """``blocks`` linear layers, each run under non-reentrant checkpointing."""

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(blocks))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            return x

    return Stack()


@pytest.mark.parametrize("saves_empty", [False, True])
def test_checkpointed_inputs_are_packed_as_the_emulated_pytorch_saves_them(saves_empty):
    """A real CPU run of eight checkpointed blocks: each checkpoint packs its input, after
    an empty tensor where PyTorch 2.1 to 2.11 is emulated (``_NoopSaveInputs`` saved
    ``torch.empty((0,))`` first); torchtune's stash then keeps the card copies of the
    inputs packed within its last 5 ids (5 inputs, or 3 with the empty tensors between),
    and the gradients are those of a run without offloading."""
    torch.manual_seed(0)
    model, x = checkpointed_stack(8), torch.randn(16, 64, requires_grad=True)
    offloader = Offloader(None, model, saves_empty=saves_empty)
    packed = []
    pack = offloader.pack
    offloader.pack = lambda tensor: packed.append(tuple(tensor.shape)) or pack(tensor)
    with offloader.forward():
        out = model(x)
    loss = out.square().sum()
    inputs = [(16, 64)] * 8
    assert packed == ([s for i in inputs for s in ((0,), i)] if saves_empty else inputs)
    last = 3 if saves_empty else 5
    assert len(offloader.forward_stash) == last
    loss.backward()
    offloaded = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(offloaded, model.parameters(), strict=True))


def test_traced_block_inputs_leave_the_card_as_the_emulated_pytorch_packs_them(tmp_path):
    """Traced with every block checkpointed and offloaded, a block's input (the previous
    block's output) leaves the card once torchtune's stash has 5 newer ids: 5 blocks later
    on PyTorch 2.12 and later, 3 blocks later on 2.11, whose checkpoints pack an empty
    tensor before each input (what a lent H200 with torch 2.11 showed)."""
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 8}))
    recipe = Recipe(
        batch_size=4, seq_len=64, precision="bf16", checkpointing="full", activation_offload=True
    )
    hidden = recipe.batch_size * recipe.seq_len * TINY_LLAMA["hidden_size"] * 2

    def blocks_later(stack: str) -> set[int]:
        """How many blocks after its birth each block output dies in the first forward."""
        built = resolve(f"hf:{config}", recipe)
        built.repeat_blocks = False
        _, trace = trace_and_estimate(built, recipe, "cuda", device_options(stack=stack))
        end = next(m.index for m in trace.phases if m.phase == Phase.BACKWARD)
        births = sorted(trace.allocations, key=lambda a: a.alloc_index)
        starts = [a.alloc_index for a in births]

        def block(index: int) -> int | None:
            module = births[bisect.bisect_right(starts, index) - 1].module
            found = re.match(r"model\.layers\.(\d+)\.", module + ".")
            return int(found.group(1)) if found else None

        later = set()
        for a in births:
            if a.nbytes == hidden and a.free_index is not None and a.free_index < end:
                born, died = block(a.alloc_index), block(a.free_index)
                if born is not None and died is not None and died > born:
                    later.add(died - born)
        return later

    assert blocks_later("torch2.14-cu12.8") == {5}
    assert blocks_later("torch2.11-cu12.8") == {3}


# -- chunked and fused cross-entropy --------------------------------------------------------


@pytest.mark.parametrize("knobs", [dict(loss_chunks=4), dict(fused_ce=True)])
def test_chunked_losses_match_a_real_cpu_run(tiny_llama, knobs):
    """The traced peak of torchtune's chunked loss and of Liger's fused loss (as modelled)
    equals PyTorch's profiler on a real CPU run of the same code within 1%."""
    recipe = Recipe(batch_size=BATCH, seq_len=SEQ, optimizer="sgd", **knobs)
    traced = trace_and_estimate(resolve(tiny_llama, recipe), recipe, "cpu")[0].peak.allocated_bytes
    real = measure_built(resolve(tiny_llama, recipe, "cpu"), recipe, "cpu", steps=2).allocated_bytes
    assert abs(traced - real) <= 0.01 * real, (traced, real)


def test_logits_are_never_whole(tiny_llama):
    """The model's own loss makes the fp32 [batch, seq, vocab] logits; the chunked loss at
    most a quarter of them at once, the fused loss one Liger chunk of rows."""
    whole = BATCH * SEQ * VOCAB * 4
    working = (Component.ACTIVATIONS, Component.TEMPORARIES)

    def sizes(**knobs) -> set[int]:
        recipe = Recipe(batch_size=BATCH, seq_len=SEQ, optimizer="sgd", **knobs)
        trace = trace_and_estimate(resolve(tiny_llama, recipe), recipe, "cpu")[1]
        return {a.nbytes for a in trace.allocations if a.category in working}

    assert max(sizes()) == whole
    chunked = sizes(loss_chunks=4)
    assert whole // 4 in chunked and max(chunked) < whole
    chunk = liger_chunk_size(BATCH * SEQ, VOCAB, TINY_LLAMA["hidden_size"])  # 4 rows
    fused = sizes(fused_ce=True)
    assert chunk * VOCAB * 4 in fused and max(fused) < whole // 4


def test_liger_chunk_size_is_its_formula():
    # BT=8192 rows, V=128256, H=4096: ceil(V/H) = 32, ceil(8192/32) = 256 rows.
    assert liger_chunk_size(8192, 128_256, 4096) == 256
    assert liger_chunk_size(100, 1000, 64) == 8  # ceil(1000/64)=16, ceil(100/16)=7 -> 8


def test_chunked_loss_needs_a_causal_lm():
    x = torch.randn(2, 256)
    with pytest.raises(UserError, match="causal LM"):
        traced_mlp(x, loss_chunks=4)


# -- DoRA -----------------------------------------------------------------------------------


def test_dora_counts_equal_peft_on_the_real_model(tiny_llama):
    """peft's own count for the same config on a real CPU model: LoRA's A and B plus one
    magnitude per output feature of each target."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    recipe = Recipe(lora_rank=4, lora_targets="q_proj,v_proj", dora=True)
    built = resolve(tiny_llama, recipe)
    traced = sum(p.numel() for p in built.model.parameters() if p.requires_grad)
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    real = peft.get_peft_model(
        transformers.LlamaForCausalLM(config),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True),
    )
    trainable, _ = real.get_nb_trainable_parameters()
    hidden, layers = TINY_LLAMA["hidden_size"], TINY_LLAMA["num_hidden_layers"]
    assert traced == trainable == layers * 2 * (4 * hidden + 4 * hidden + hidden)
