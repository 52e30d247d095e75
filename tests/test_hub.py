"""Hugging Face hub ids: the user's Hub cache, the Hub (mocked: config files only), the
bundled catalog, and the answers when none of them has the model. No test reaches the
network: the cache is a temporary folder laid out as huggingface_hub lays it out, and
HF_HUB_OFFLINE is set unless a test mocks the download function itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramplan.errors import UserError
from vramplan.pipeline import estimate_built
from vramplan.recipe import Recipe
from vramplan.sources import hub, resolve
from vramplan.sources.configs import load_config_dict

TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
# embeddings + 2 x (q, k, v, o, gate/up/down, two norms) + final norm + head, by hand
TINY_LLAMA_PARAMS = 128 * 32 + 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32
TINY_LLAMA_PARAMS += 128 * 32
COMMIT = "a" * 40


def write_cached(root: Path, repo: str, config: dict, ref: str = "main", commit=COMMIT) -> Path:
    """``config`` as the Hub's cache holds ``repo`` at ``ref``: refs/REF names a commit and
    snapshots/COMMIT/config.json is the file."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot / "config.json"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache in HF_HUB_CACHE, offline."""
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def test_a_hub_id_is_read_from_the_cache(hub_cache, run_cli):
    write_cached(hub_cache, "acme/tiny-llama", TINY_LLAMA)
    label, config = load_config_dict("acme/tiny-llama")
    assert (label, config) == ("acme/tiny-llama", TINY_LLAMA)
    code, out, err = run_cli("llm", "hf:acme/tiny-llama", "--seq-len", "16", "--json")
    assert code == 0, err
    assert json.loads(out)["model"]["parameters"] == TINY_LLAMA_PARAMS


def test_the_cache_is_found_under_hf_home(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_cached(tmp_path / "hub", "acme/tiny-llama", TINY_LLAMA)
    assert load_config_dict("acme/tiny-llama")[1] == TINY_LLAMA


def test_revisions_branches_tags_and_commits(hub_cache):
    write_cached(hub_cache, "acme/tiny-llama", TINY_LLAMA)
    wider = {**TINY_LLAMA, "hidden_size": 64}
    write_cached(hub_cache, "acme/tiny-llama", wider, ref="v2", commit="b" * 40)
    assert load_config_dict("acme/tiny-llama")[1]["hidden_size"] == 32
    label, config = load_config_dict("acme/tiny-llama@v2")
    assert label == "acme/tiny-llama@v2" and config["hidden_size"] == 64
    assert load_config_dict(f"acme/tiny-llama@{'b' * 40}")[1]["hidden_size"] == 64
    with pytest.raises(UserError, match="unknown hf model 'acme/tiny-llama@v3'"):
        load_config_dict("acme/tiny-llama@v3")


def test_the_cache_comes_before_the_bundled_catalog(hub_cache):
    bundled = load_config_dict("meta-llama/Llama-3.2-3B")[1]
    assert bundled["num_hidden_layers"] == 28
    write_cached(hub_cache, "meta-llama/Llama-3.2-3B", {**bundled, "num_hidden_layers": 2})
    assert load_config_dict("meta-llama/Llama-3.2-3B")[1]["num_hidden_layers"] == 2


def test_the_short_names_still_work(hub_cache):
    for short, hub_id in [
        ("gpt2", "openai-community/gpt2"),
        ("meta-llama-3-8b", "meta-llama/Meta-Llama-3-8B"),
        ("llama-2-7b", "meta-llama/Llama-2-7b-hf"),
        ("tinyllama-1.1b", "TinyLlama/TinyLlama-1.1B-Chat-v1.0"),
        ("qwen2.5-7b", "Qwen/Qwen2.5-7B"),
        ("meta-llama/llama-3-8b", "meta-llama/Meta-Llama-3-8B"),
        ("Llama-3.2-3B", "meta-llama/Llama-3.2-3B"),
    ]:
        assert load_config_dict(short)[0] == hub_id, short


def test_an_unknown_id_suggests_close_ones(hub_cache, run_cli):
    code, out, err = run_cli("llm", "hf:meta-llama/Llama-3.2-3B-Instrct")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "unknown hf model" in err and "HF_HUB_OFFLINE is set" in err
    assert "did you mean meta-llama/Llama-3.2-3B-Instruct" in err


class FakeHub:
    """Stands in for ``huggingface_hub.hf_hub_download``: records what was asked for and
    answers from ``files`` (repo -> config) or raises ``error``."""

    def __init__(self, folder: Path, files: dict | None = None, error=None):
        self.folder, self.files, self.error, self.asked = folder, files or {}, error, []

    def __call__(self, repo_id, filename, revision=None, cache_dir=None, **_):
        self.asked.append((repo_id, filename, revision))
        if self.error is not None:
            raise self.error
        path = self.folder / repo_id.replace("/", "--") / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.files[repo_id]))
        return str(path)


@pytest.fixture
def online(hub_cache, monkeypatch):
    """Online: HF_HUB_OFFLINE unset and the endpoint taken as reachable; the test installs
    its FakeHub as huggingface_hub's download function."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "_reachable", lambda: True)

    def install(fake: FakeHub) -> FakeHub:
        import huggingface_hub

        monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
        return fake

    return install


def test_online_only_the_config_file_is_downloaded(online, tmp_path):
    fake = online(FakeHub(tmp_path / "dl", {"acme/new-model": TINY_LLAMA}))
    assert load_config_dict("acme/new-model@dev") == ("acme/new-model@dev", TINY_LLAMA)
    assert fake.asked == [("acme/new-model", "config.json", "dev")]


def test_a_gated_model_says_how_to_authenticate(online, tmp_path, run_cli):
    from huggingface_hub.utils import GatedRepoError

    fake = online(FakeHub(tmp_path, error=GatedRepoError.__new__(GatedRepoError)))
    code, out, err = run_cli("estimate", "hf:acme/gated-model")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "gated" in err and "huggingface-cli login" in err and "HF_TOKEN" in err
    assert "Traceback" not in err
    assert {filename for _, filename, _ in fake.asked} == {"config.json"}


def test_a_gated_model_that_is_bundled_uses_the_bundled_config(online, tmp_path):
    from huggingface_hub.utils import GatedRepoError

    online(FakeHub(tmp_path, error=GatedRepoError.__new__(GatedRepoError)))
    label, config = load_config_dict("meta-llama/Llama-3.2-3B")
    assert label == "meta-llama/Llama-3.2-3B" and config["hidden_size"] == 3072
    with pytest.raises(UserError, match="gated"):  # a revision the catalog does not hold
        load_config_dict("meta-llama/Llama-3.2-3B@refs/pr/1")


def test_an_unreachable_hub_falls_back_to_the_catalog(online, tmp_path):
    from huggingface_hub.utils import LocalEntryNotFoundError

    online(FakeHub(tmp_path, error=LocalEntryNotFoundError("no connection")))
    assert load_config_dict("Qwen/Qwen2.5-7B")[1]["hidden_size"] == 3584


def test_remote_code_is_not_run(hub_cache, run_cli):
    custom = {**TINY_LLAMA, "model_type": "acme_net", "auto_map": {"AutoConfig": "c.AcmeConfig"}}
    write_cached(hub_cache, "acme/custom", custom)
    code, _, err = run_cli("estimate", "hf:acme/custom")
    assert code == 2 and err.count("\n") == 1
    assert "ships its own modeling code" in err and "--trust-remote-code" in err


ACME_CONFIG_CODE = """
from transformers import PretrainedConfig

class AcmeConfig(PretrainedConfig):
    model_type = "acme_tiny"

    def __init__(self, hidden_size=8, num_hidden_layers=2, vocab_size=16, **kwargs):
        self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
        self.vocab_size = vocab_size
        super().__init__(**kwargs)
"""
ACME_MODEL_CODE = """
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput
from .configuration_acme import AcmeConfig

class AcmeForCausalLM(PreTrainedModel):
    config_class = AcmeConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            nn.Linear(config.hidden_size, config.hidden_size)
            for _ in range(config.num_hidden_layers)
        )
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids, labels=None, **kwargs):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        logits = self.head(x)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return CausalLMOutput(loss=loss, logits=logits)
"""


def test_a_repositorys_own_code_runs_only_when_trusted(tmp_path, run_cli):
    folder = tmp_path / "acme"
    folder.mkdir()
    (folder / "configuration_acme.py").write_text(ACME_CONFIG_CODE)
    (folder / "modeling_acme.py").write_text(ACME_MODEL_CODE)
    config = {
        "model_type": "acme_tiny",
        "architectures": ["AcmeForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_acme.AcmeConfig",
            "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM",
        },
        "hidden_size": 8,
        "num_hidden_layers": 2,
        "vocab_size": 16,
    }
    (folder / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli("estimate", f"hf:{folder}", "--seq-len", "4")
    assert code == 2 and out == "" and "--trust-remote-code" in err
    code, out, err = run_cli(
        "estimate", f"hf:{folder}", "--seq-len", "4", "--trust-remote-code", "--json"
    )
    assert code == 0, err
    model = json.loads(out)["model"]
    # embedding 16x8, two 8x8 layers with biases, an 8x16 head
    assert model["architecture"] == "AcmeForCausalLM"
    assert model["parameters"] == 16 * 8 + 2 * (8 * 8 + 8) + 8 * 16


@pytest.mark.parametrize("precision,width", [("fp32", 4), ("amp-bf16", 4), ("bf16", 2)])
def test_the_recipe_not_the_config_s_dtype_sizes_the_weights(gpt2_config, precision, width):
    """Hub configs name their checkpoint's dtype (``torch_dtype: bfloat16``); training in
    fp32 or amp keeps fp32 weights all the same."""
    path = gpt2_config(torch_dtype="bfloat16")
    recipe = Recipe(batch_size=1, seq_len=8, precision=precision)
    built = resolve(f"hf:{path}", recipe)
    count = sum(p.numel() for p in built.model.parameters())
    estimate = estimate_built(built, recipe, target="cpu")
    assert estimate.components["parameters"] == count * width
