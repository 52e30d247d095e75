"""The command line: the JSON contract, and one clear line with exit code 2 for bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(
        "import torch\n"
        "from torch import nn\n"
        "def make():\n"
        "    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))\n"
        "def broken():\n"
        "    raise RuntimeError('no such layer')\n"
        "class DataDependent(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(16, 4)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x[x > 0].reshape(-1, 16))\n"
        "def data_dependent():\n"
        "    return DataDependent()\n"
        "not_callable = 3\n"
    )
    return path


def test_json_contract(run_cli, tiny_gpt2_config):
    code, out, _ = run_cli(
        "estimate",
        f"hf:{tiny_gpt2_config}",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--optimizer",
        "sgd",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert data["schema"] == "vramplan.estimate/1"
    assert data["peak"]["phase"] in ("forward", "backward", "optimizer")
    assert set(data["components"]) == {
        "parameters",
        "buffers",
        "gradients",
        "optimizer_state",
        "activations",
        "temporaries",
        "inputs",
        "kv_cache",
    }
    assert all(isinstance(v, int) for v in data["components"].values())
    assert data["recipe"]["batch_size"] == 2 and data["recipe"]["seq_len"] == 32
    assert data["recipe"]["optimizer"] == "sgd"
    # 512*32 (tied wte) + 64*32 (wpe) + 2 blocks * (12*32*32 + 13*32) + 2*32 (final LN)
    assert data["model"]["parameters"] == 512 * 32 + 64 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 64
    assert set(data["summary"]) == {
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "workspace",
    }


def test_file_factory_and_terminal_output(run_cli, model_file):
    code, out, err = run_cli("estimate", f"{model_file}:make", "--batch-size", "8")
    assert code == 0, err
    # the peak line gives a binary-unit size and the exact bytes: "2.0 MiB (2,115,584 bytes)"
    assert re.search(r"^Peak allocated: [\d.]+ (KiB|MiB) \([\d,]+ bytes\)", out, re.M), out
    code, out, _ = run_cli("estimate", f"{model_file}:make", "--units", "decimal")
    assert code == 0 and " kB" in out and "decimal units" in out


@pytest.mark.parametrize(
    "args,expected",
    [
        (["torchvision:resnet5O"], "unknown torchvision model"),
        (["hf:not-a-model"], "unknown hf model"),
        (["nonsense"], "cannot read model"),
        (["missing/file.py:make"], "model file not found"),
        (["{model_file}:nope"], "has no attribute 'nope'"),
        (["{model_file}:not_callable"], "is not callable"),
        (["{model_file}:broken"], "factory {model_file}:broken raised RuntimeError"),
        (["{model_file}:data_dependent"], "shapes but no values"),
        (["{model_file}:make", "--batch-size", "0"], "batch size must be a positive integer"),
        (["{model_file}:make", "--batch-size", "-3"], "batch size must be a positive integer"),
        (["{model_file}:make", "--input-shape", "3xAx4"], "cannot read shape"),
        (["{model_file}:make", "--input-shape", "8"], "failed on the example batch"),
        (["{model_file}:make", "--precision", "fp8"], "unknown precision 'fp8'"),
        (["{model_file}:make", "--optimizer", "sgdd"], "unknown optimizer 'sgdd'"),
        (["{model_file}:make", "--checkpointing", "half"], "unknown checkpointing"),
        (["{model_file}:make", "--mode", "serve"], "unknown mode"),
        (["{model_file}:make", "--units", "si"], "unknown units"),
        (["{model_file}:make", "--no-such-flag"], "No such option"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(run_cli, model_file, args, expected):
    args = [a.replace("{model_file}", str(model_file)) for a in args]
    code, out, err = run_cli("estimate", *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert expected.replace("{model_file}", str(model_file)) in lines[0]
    assert "Traceback" not in err


def test_malformed_config_json(run_cli, tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{ not json")
    code, _, err = run_cli("estimate", f"hf:{path}")
    assert code == 2 and "malformed config JSON" in err
    assert path.read_text() == "{ not json"  # the user's file is untouched


def test_seq_len_beyond_learned_positions(run_cli, tiny_gpt2_config):
    code, _, err = run_cli("estimate", f"hf:{tiny_gpt2_config}", "--seq-len", "65")
    assert code == 2 and "64 learned positions" in err


def test_installed_script_reports_errors_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "vramplan", "estimate", "torchvision:nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("vramplan: error: unknown torchvision model")
    assert "Traceback" not in result.stderr


def test_models_lists_bundled_configs(run_cli):
    code, out, _ = run_cli("models", "hf")
    assert code == 0
    listed = out.split()
    assert "hf:openai-community/gpt2" in listed and "hf:meta-llama/Meta-Llama-3-8B" in listed
    code, _, err = run_cli("models", "bogus")
    assert code == 2 and "unknown source" in err


@pytest.mark.parametrize(
    "flag,hint",
    [
        ("--gpus", "did you mean --gpu?"),
        ("--batch", "--batch-size"),
        ("--colour", "--help"),
        ("--precomputed-latents", "vramplan spells it --diffusion-encoders precomputed"),
    ],
)
def test_unknown_flags_suggest_only_flags_that_look_alike(run_cli, flag, hint):
    code, out, err = run_cli("estimate", "hf:gpt2", flag, "1")
    assert code == 2 and out == "" and hint in err and err.count("\n") == 1
    assert "--tp" not in err and "--units" not in err


def test_the_issue_spellings_of_the_torchtune_tricks_are_the_same_flags(run_cli, tiny_gpt2_config):
    """``--offload-activations`` and ``--chunked-loss N`` (torchtune's and the fine-tuning
    issue's words) are ``--activation-offload`` and ``--loss-chunks N``."""
    common = ("estimate", f"hf:{tiny_gpt2_config}", "--seq-len", "32", "--checkpointing", "full")
    recipes = []
    for flags in (
        ("--activation-offload", "--loss-chunks", "4"),
        ("--offload-activations", "--chunked-loss", "4"),
    ):
        code, out, err = run_cli(*common, *flags, "--json")
        assert code == 0, err
        recipes.append(json.loads(out)["recipe"])
    assert recipes[0] == recipes[1]
    assert recipes[0]["activation_offload"] is True and recipes[0]["loss_chunks"] == 4
