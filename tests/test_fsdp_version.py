"""``--fsdp-version 1`` (FSDP1, accelerate's default) from the command line and from an
accelerate config: the FSDP2 trace plus the hold of ``Fsdp2(hold_block_inputs=True)`` where
FSDP1 keeps block inputs (a frozen unit recomputed by reentrant checkpointing), and nothing
more where it does not."""

from __future__ import annotations

import json

import pytest
from conftest import gqa_llama

from vramplan.configs import read_config
from vramplan.device.options import device_options
from vramplan.distributed.fsdp import Fsdp2
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources import resolve

# a small vocabulary, so the held block states (not the logits) decide the backward peak
LLAMA = {**gqa_llama(3), "vocab_size": 32}
STEP = ("--batch-size", "2", "--seq-len", "32", "--checkpointing", "full")
LORA = ("--precision", "amp-bf16", "--lora", "4")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("fsdp_version") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return f"hf:{path}"


_ESTIMATES: dict[tuple[str, ...], dict] = {}
RANK = ("--fsdp", "2", "--gpu", "a100-80gb", "--full-trace")


@pytest.fixture
def estimate(run_cli, llama):
    """``estimate(*flags)``: the JSON estimate of one rank of ``--fsdp 2`` (each set of
    flags traced once in this module)."""

    def run(*flags: str) -> dict:
        if flags not in _ESTIMATES:
            code, out, err = run_cli("estimate", llama, *STEP, *RANK, "--json", *flags)
            assert code == 0, err
            _ESTIMATES[flags] = json.loads(out)
        return _ESTIMATES[flags]

    return run


@pytest.fixture
def peak(estimate):
    """``peak(*flags)``: the allocated peak of one rank of ``--fsdp 2`` and its notes."""

    def run(*flags: str) -> tuple[int, list[str]]:
        result = estimate(*flags)
        return result["peak"]["allocated_bytes"], result["notes"]

    return run


def test_version_1_adds_the_hold_where_fsdp1_holds(peak, llama):
    v1, notes = peak(*LORA, "--fsdp-version", "1", "--reentrant")
    recipe = Recipe(
        batch_size=2, seq_len=32, checkpointing="full", precision="amp-bf16", lora_rank=4
    )
    device = device_options(gpu="a100-80gb", data_parallel=2)
    engine = Fsdp2(2, hold_block_inputs=True)
    held = estimate_built(resolve(llama, recipe), recipe, "cuda", device, engine=engine)
    v2, _ = peak(*LORA)
    assert v1 == held.peak.allocated_bytes
    assert v1 > v2  # the hold decides the peak here
    assert any(n.startswith("FSDP1: 3 frozen blocks recomputed by reentrant") for n in notes)


def test_check_takes_the_version(run_cli, llama):
    """``check --fsdp-version 1`` judges what ``estimate`` does under the same flags: the
    hold FSDP1 adds (LoRA, reentrant checkpointing; 32 samples of 128 tokens, so that it
    reaches the device total) makes its device total larger than FSDP2's."""
    step = ("--batch-size", "32", "--seq-len", "128", "--checkpointing", "full", *LORA)
    totals = {}
    for version in ("1", "2"):
        flags = (*step, "--reentrant", "--fsdp", "2", "--fsdp-version", version)
        code, out, err = run_cli("check", llama, *flags, "--gpu", "a100-80gb", "--json")
        assert code == 0, err
        answer = json.loads(out)
        assert answer["fits"] and answer["exit_code"] == 0
        totals[version] = answer["device_total_bytes"]
        code, out, err = run_cli("estimate", llama, *flags, "--gpu", "a100-80gb", "--json")
        assert json.loads(out)["peak"]["device_total_bytes"] == totals[version]
    assert totals["1"] > totals["2"]


@pytest.mark.parametrize(
    "flags",
    [
        LORA,  # non-reentrant checkpointing: FSDP1 hooks the real inputs, which it frees
        ("--reentrant",),  # full fine-tuning: every block's flat parameter requires grad
    ],
)
def test_version_1_without_the_hold_is_version_2(peak, flags):
    v1, notes = peak(*flags, "--fsdp-version", "1")
    v2, _ = peak(*flags)
    assert v1 == v2
    assert any(n.startswith("FSDP1: nothing held") for n in notes)


@pytest.mark.parametrize(
    ("written", "version"),
    [("fsdp_version: 1\n", 1), ("", 1), ("fsdp_version: 2\n", 2)],  # absent: accelerate's 1
)
def test_accelerate_config_sets_the_version(tmp_path, written, version):
    path = tmp_path / "fsdp.yaml"
    path.write_text(
        "distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n"
        "  fsdp_sharding_strategy: FULL_SHARD\n" + (f"  {written}" if written else "")
    )
    config = read_config(str(path))
    assert config.options["fsdp_version"] == version
    assert config.layout().fsdp_version == version
    assert config.with_flags(zero=3).layout().describe() == "zero3 dp=1"


def test_a_bad_version_is_one_line(run_cli, llama):
    code, out, err = run_cli("estimate", llama, "--fsdp", "2", "--fsdp-version", "3")
    assert code == 2
    assert err.strip() == "vramplan: error: --fsdp-version must be 1 or 2, got 3"
    code, out, err = run_cli("estimate", llama, "--zero", "2", "--fsdp-version", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "goes with FSDP" in err


def test_training_arguments_set_the_version_and_reentrant_checkpointing():
    from vramplan.configs.training_args import read_training_args

    values = {"gradient_checkpointing": True, "fsdp": "full_shard", "fsdp_config": {}}
    reentrant = {"gradient_checkpointing_kwargs": {"use_reentrant": True}}
    config = read_training_args({**values, **reentrant, "fsdp_config": {"version": 1}}, {}, 4)
    assert config.recipe().reentrant and config.layout().describe() == "fsdp dp=4 fsdp-version=1"
    unset = read_training_args(values, {}, 4)  # transformers 5's defaults: FSDP2, non-reentrant
    assert not unset.recipe().reentrant and unset.layout().fsdp_version == 2
    assert any("give --reentrant" in note for note in unset.notes)


@pytest.mark.parametrize(
    ("transformers", "fsdp_config", "version"),
    [
        ("4.57.1", {}, 1),  # 4.x reads no version: accelerate's FSDP_VERSION, "1" unset
        ("4.57.1", {"version": 2}, 1),  # ... not even one given
        ("5.24.0", {}, 2),  # 5: fsdp_config.get("version", 2)
        ("5.24.0", {"version": 1}, 1),
        (None, {}, 2),  # a dump of unknown version: FSDP2, said in a note
    ],
)
def test_training_arguments_version_follows_the_transformers_that_runs_them(
    transformers, fsdp_config, version
):
    from vramplan.configs.training_args import read_training_args

    values = {"fsdp": "full_shard", "fsdp_config": fsdp_config}
    config = read_training_args(values, {}, 4, transformers_version=transformers)
    assert config.layout().fsdp_version == version
    unknown = [note for note in config.notes if "does not say which transformers" in note]
    assert bool(unknown) == (transformers is None)
    assert "fsdp_config.version" not in config.ignored
