"""Block repetition where the blocks are not all alike once the recipe is applied (some
checkpointed, some not): the rebuilt trace equals the full trace, event for event."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import assert_same_estimate, gqa_llama

from vramplan.device.options import device_options
from vramplan.pipeline import trace_and_estimate
from vramplan.recipe import Recipe
from vramplan.sources import resolve
from vramplan.sources.blocks import block_containers
from vramplan.trace.repeat import find_run, shell, signature


@pytest.fixture(autouse=True)
def _short_runs_repeat_too(monkeypatch):
    """The tiny model here has 10 blocks; repetition's thresholds are a speed policy."""
    monkeypatch.setattr("vramplan.trace.repeat.MIN_BLOCKS", 5)
    monkeypatch.setattr("vramplan.trace.repeat.SHORTER", 10.0)


def _both(tmp_path, layers: int, stack: str | None = None, **knobs):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(gqa_llama(layers)))
    recipe = Recipe(batch_size=2, seq_len=32, **knobs)
    device = device_options(gpu="a100-80gb", stack=stack)
    results = []
    for repeat in (False, True):
        built = resolve(f"hf:{path}", recipe)
        built.repeat_blocks = repeat
        results.append(trace_and_estimate(built, recipe, "cuda", device))
    return results


def test_every_second_block_checkpointed(tmp_path):
    """One stretch whose unit is two blocks (a plain one, then a checkpointed one)."""
    full, repeated = _both(tmp_path, 10, checkpointing="every:2", precision="amp-bf16")
    note = "repeated blocks: the 10 model.layers blocks are stretches of 5 units of 2 blocks"
    assert_same_estimate(full, repeated, note)


@pytest.mark.parametrize("stack", [None, "torch2.11-cu12.8"])
def test_offloaded_checkpointed_blocks_repeat_in_units_of_the_stash(tmp_path, stack):
    """Activation offloading keeps a checkpointed block's input on the card until
    FORWARD_STASH (5) later tensors are offloaded: units of 5 blocks repeat, and the block
    left over is a tail traced as it is; also where each checkpoint packs an empty tensor
    first (PyTorch 2.11), so that an input dies 3 blocks later."""
    full, repeated = _both(
        tmp_path, 26, stack, checkpointing="full", activation_offload=True, precision="amp-bf16"
    )
    note = (
        "repeated blocks: the 26 model.layers blocks are stretches of 5 units of 5 blocks "
        "and 1 block (an offloaded block input stays on the card up to 5 blocks)"
    )
    assert_same_estimate(full, repeated, note)


def test_a_frozen_embedding_under_offloading_repeats_in_units_of_the_stash(tmp_path, monkeypatch):
    """LoRA freezes the embedding: its output is a leaf the offloader holds to the end of
    the step. A stash of two tensors keeps the model short (units of 2 blocks)."""
    monkeypatch.setattr("vramplan.trace.tricks.FORWARD_STASH", 2)
    lora = {"precision": "bf16", "lora_rank": 4, "lora_targets": "all-linear"}
    full, repeated = _both(tmp_path, 11, checkpointing="full", activation_offload=True, **lora)
    note = (
        "repeated blocks: the 11 base_model.model.model.layers blocks are stretches of 5 "
        "units of 2 blocks and 1 block (an offloaded block input stays on the card up to 2"
    )
    assert_same_estimate(full, repeated, note)


@pytest.mark.parametrize(
    "source,knobs",
    [
        ("llama", {}),
        ("llama", {"lora_rank": 4, "lora_targets": "all-linear"}),
        ("user", {"input_shape": (16,)}),
    ],
    ids=["hf", "hf-lora", "user-code"],
)
def test_checkpointing_a_shell_marks_what_a_deep_copy_marks_and_leaves_the_model(
    tmp_path, source, knobs
):
    """``_check_recomputed`` switches checkpointing on in a ``shell`` of the model (new
    modules sharing the tensors): the blocks come out as on a deep copy (the first two
    recomputed, alike, the others alike), and the model's own modules keep every attribute
    as it was (Hugging Face's flags and hooks, a user block's ``forward``)."""
    if source == "llama":
        path = tmp_path / "llama.json"
        path.write_text(json.dumps(gqa_llama(6)))
        spec = f"hf:{path}"
    else:
        path = tmp_path / "mlp.py"
        path.write_text(
            "from torch import nn\n"
            "class Block(nn.Module):\n"
            "    def __init__(self):\n"
            "        super().__init__()\n"
            "        self.fc = nn.Linear(16, 16)\n"
            "    def forward(self, x):\n"
            "        return nn.functional.relu(self.fc(x)) + x\n"
            "def make():\n"
            "    blocks = nn.Sequential(*[Block() for _ in range(6)])\n"
            "    return nn.Sequential(blocks, nn.Linear(16, 4))\n"
        )
        spec = f"{path}:make"
    recipe = Recipe(batch_size=2, seq_len=32 if source == "llama" else None, **knobs)
    built = resolve(spec, recipe.with_changes(checkpointing="2"))
    model = built.model
    run = find_run(model, block_containers(model))

    def blocks(copied):
        return list(copied.get_submodule(run.path).children())[run.start : run.end]

    def checkpointed(copied):
        built.enable_checkpointing(copied, 2, 1, False)
        return [signature(block) for block in blocks(copied)]

    before = [(m, dict(vars(m))) for m in model.modules()]
    marked = checkpointed(shell(model))
    assert marked == checkpointed(copy.deepcopy(model))
    assert marked[0] == marked[1] != marked[2] and len(set(marked[2:])) == 1
    for module, attributes in before:
        assert vars(module).keys() == attributes.keys()
        assert all(vars(module)[k] is v for k, v in attributes.items())
        assert all(
            dict(v) == dict(attributes[k]) if isinstance(v, dict) else True
            for k, v in vars(module).items()
        )
