"""The bundled catalog: configs under their hub ids with licence and source, parameter
counts equal to the published ones when built the way ``estimate`` builds them, and
``vramplan models --search``."""

from __future__ import annotations

import json
import shutil
from importlib import resources

import pytest

from vramplan import Recipe
from vramplan.sources import resolve
from vramplan.sources.catalog import catalog_entries, entry_config, find_entry
from vramplan.sources.configs import validate_config

# Published parameter counts (the checkpoints' safetensors totals on the Hub, and the
# DeepSeek-V2-Lite model card's 15.7B to the parameter); the issue's list.
PUBLISHED = {
    "meta-llama/Llama-3.2-3B": 3_212_749_824,
    "mistralai/Mixtral-8x7B-v0.1": 46_702_792_704,
    "Qwen/Qwen2.5-7B": 7_615_616_512,
    "deepseek-ai/DeepSeek-V2-Lite": 15_706_484_224,
    "google/gemma-2-2b": 2_614_341_888,
    "microsoft/phi-2": 2_779_683_840,
    "facebook/opt-350m": 331_196_416,
}
# What the issue asks the catalog to hold, one id per family.
REQUIRED = [
    "meta-llama/Llama-2-7b-hf",
    "meta-llama/Meta-Llama-3-8B",
    "meta-llama/Llama-3.1-405B",
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.3-70B-Instruct",
    "mistralai/Mistral-7B-v0.1",
    "mistralai/Mixtral-8x22B-v0.1",
    "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen2.5-72B",
    "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen3-235B-A22B",
    "google/gemma-2-9b",
    "google/gemma-3-4b-pt",
    "microsoft/Phi-3-mini-4k-instruct",
    "microsoft/Phi-3.5-mini-instruct",
    "microsoft/phi-4",
    "deepseek-ai/DeepSeek-V3",
    "EleutherAI/pythia-1b",
    "tiiuae/falcon-7b",
    "openai-community/gpt2",
    "EleutherAI/gpt-j-6b",
    "EleutherAI/gpt-neox-20b",
    "google-t5/t5-base",
    "google/flan-t5-base",
    "google-bert/bert-base-uncased",
    "FacebookAI/roberta-base",
    "microsoft/deberta-v3-base",
    "google/vit-base-patch16-224",
    "facebook/dinov2-base",
    "openai/clip-vit-base-patch32",
    "google/siglip-base-patch16-224",
    "openai/whisper-small",
    "llava-hf/llava-1.5-7b-hf",
    "Qwen/Qwen2-VL-2B-Instruct",
]


def test_the_catalog_holds_the_models_people_use():
    entries = catalog_entries()
    ids = [e.hub_id for e in entries]
    assert len(ids) >= 80 and len(set(ids)) == len(ids)
    assert [i for i in REQUIRED if i not in ids] == []
    for entry in entries:
        assert entry.licence and entry.family and entry.params > 0, entry.hub_id
        assert entry.source == f"https://huggingface.co/{entry.hub_id}/blob/main/config.json"
        validate_config(entry.hub_id, entry_config(entry))
        assert find_entry(entry.hub_id) == entry
        for alias in entry.aliases:  # an alias names one entry only
            assert find_entry(alias) == entry, alias


@pytest.fixture
def cache_of_the_issues_models(tmp_path, monkeypatch):
    """The issue's models as a Hub cache holds them (offline), copied from the catalog."""
    for hub_id in PUBLISHED:
        folder = tmp_path / f"models--{hub_id.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text("c" * 40)
        (folder / "snapshots" / ("c" * 40)).mkdir(parents=True)
        org, name = hub_id.split("/")
        source = resources.files("vramplan") / "data" / "hf" / org / f"{name}.json"
        with resources.as_file(source) as path:
            shutil.copy(path, folder / "snapshots" / ("c" * 40) / "config.json")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("hub_id", list(PUBLISHED))
def test_models_build_with_their_published_parameter_counts(hub_id, cache_of_the_issues_models):
    built = resolve(f"hf:{hub_id}", Recipe(batch_size=1, seq_len=16))
    assert built.model.parameters().__next__().device.type == "meta"
    assert sum(p.numel() for p in built.model.parameters()) == PUBLISHED[hub_id]
    assert find_entry(hub_id).params == PUBLISHED[hub_id]


def test_an_estimate_from_the_cache_counts_the_published_parameters(
    cache_of_the_issues_models, run_cli
):
    code, out, err = run_cli(
        "estimate", "facebook/opt-350m", "--seq-len", "8", "--mode", "infer", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["model"]["parameters"] == PUBLISHED["facebook/opt-350m"]


def test_llm_formulas_count_the_published_parameters(run_cli):
    for hub_id, count in PUBLISHED.items():
        code, out, err = run_cli("llm", hub_id, "--json")
        assert code == 0, err
        assert json.loads(out)["model"]["parameters"] == count, hub_id


def test_models_search_finds_hub_ids_with_params_and_licence(run_cli):
    code, out, err = run_cli("models", "hf", "--search", "mixtral")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [r[0] for r in rows] == [
        "hf:mistralai/Mixtral-8x7B-v0.1",
        "hf:mistralai/Mixtral-8x7B-Instruct-v0.1",
        "hf:mistralai/Mixtral-8x22B-v0.1",
    ]
    assert rows[0][1:3] == ["46,702,792,704", "apache-2.0"]
    code, out, _ = run_cli("models", "--search", "qwen3 moe", "--json")
    found = json.loads(out)
    assert [r["name"] for r in found] == ["hf:Qwen/Qwen3-30B-A3B", "hf:Qwen/Qwen3-235B-A22B"]
    assert all(r["licence"] == "apache-2.0" for r in found)
    code, out, _ = run_cli("models", "--search", "resnet50")
    assert code == 0 and "torchvision:resnet50" in out.split()
    code, out, err = run_cli("models", "hf", "--search", "no-such-model")
    assert code == 1 and out == "" and "no model matches" in err
