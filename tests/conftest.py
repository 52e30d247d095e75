"""Shared fixtures: the command line in-process, a tiny GPT-2 config, a fixed seed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from vramplan.cli import main
from vramplan.device.options import device_options
from vramplan.planner.bench import Workbench
from vramplan.recipe import Recipe
from vramplan.sources import resolve
from vramplan.sources.base import BuiltModel

# Two blocks of width 32 over a 512-token vocabulary: builds and traces in well under a
# second, and its parameter count is easy to write out by hand.
TINY_GPT2 = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 512,
    "n_positions": 64,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
}
NO_DROPOUT = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}


@pytest.fixture(scope="session")
def gpt2_config(tmp_path_factory) -> Callable[..., Path]:
    """``gpt2_config(**overrides)`` writes the tiny GPT-2 config with ``overrides`` (use
    ``no_dropout=True`` for a deterministic attention kernel choice) to a fresh folder and
    returns the config.json's path; ``hf:PATH`` names the model."""

    def write(no_dropout: bool = False, **overrides) -> Path:
        path = tmp_path_factory.mktemp("gpt2") / "config.json"
        path.write_text(
            json.dumps({**TINY_GPT2, **(NO_DROPOUT if no_dropout else {}), **overrides})
        )
        return path

    return write


@pytest.fixture
def tiny_gpt2_config(gpt2_config) -> Path:
    """The tiny GPT-2 config.json as written by ``gpt2_config()``."""
    return gpt2_config()


# A two-layer Llama over a 2048-token vocabulary: the fine-tuning and loss tests' model.
TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 2048,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
PLAN_LLAMA = {  # the plan tests' Llama: two blocks, untied head, 512 positions
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
MID_LLAMA = {  # a 340M-parameter Llama: 131M of it embeddings and head
    **TINY_LLAMA,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}


def hf_name(folder: Path, config: dict) -> str:
    """``hf:`` name of ``config`` written as ``folder/config.json``."""
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return f"hf:{path}"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """``hf:`` name of TINY_LLAMA's config written to a temporary file."""
    pytest.importorskip("transformers")
    return hf_name(tmp_path_factory.mktemp("llama"), TINY_LLAMA)


# A one-layer CLIP vision tower over 56 x 56 images: 16 patches of 14 x 14.
TINY_VISION = {
    "model_type": "clip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "image_size": 56,
    "patch_size": 14,
}
# The text stack of the tiny vision-language models: two layers over a 96-token vocabulary.
TINY_TEXT = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# A Gemma 3 vision-language model: a 1-layer SigLIP tower over 56 x 56 images (16 patches,
# pooled to 4 image tokens) and a 2-layer text stack.
TINY_GEMMA3 = {
    "model_type": "gemma3",
    "architectures": ["Gemma3ForConditionalGeneration"],
    "image_token_index": 95,
    "boi_token_index": 93,
    "eoi_token_index": 94,
    "mm_tokens_per_image": 4,
    "vision_config": {**TINY_VISION, "model_type": "siglip_vision_model", "vision_use_head": False},
    "text_config": {**TINY_TEXT, "model_type": "gemma3_text", "head_dim": 8, "sliding_window": 8},
}


# A two-level diffusers UNet over 8 × 8 latents: the diffusion tests' model.
TINY_UNET = {
    "_class_name": "UNet2DConditionModel",
    "block_out_channels": [32, 64],
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "layers_per_block": 1,
    "cross_attention_dim": 32,
    "attention_head_dim": 8,
    "norm_num_groups": 8,
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
}


def gqa_llama(layers: int) -> dict:
    """A narrow Llama config with grouped-query attention and ``layers`` blocks (the
    block-repetition tests vary the depth)."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }


@pytest.fixture
def run_cli(capsys) -> Callable[..., tuple[int, str, str]]:
    """``run_cli(*args)`` runs ``vramplan ARGS`` in-process: (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


def onednn_runs(dtype: str) -> bool:
    """Whether this CPU runs oneDNN's ``bf16`` or ``fp16`` kernels (AVX512-BF16/AMX,
    AVX512-FP16/AMX-FP16). On such a host a real CPU step in that dtype takes oneDNN's
    paths (reordered weights, scratchpads) that the trace of a CPU step does not model
    yet: it read 2.2% short of a bf16 convolution step and 10% short of an fp16 T5 step
    on an Intel Xeon with AMX (2026-11-29). Elsewhere ATen's own kernels run, which the
    trace matches."""
    from vramplan.trace.cpu_conv import Host

    host = Host.here()
    return host.mkldnn_bf16 if dtype == "bf16" else host.mkldnn_fp16


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture
def tiny_cnn(tmp_path):
    """A small residual CNN in a user file, as ``path.py:make``."""
    path = tmp_path / "cnn.py"
    path.write_text(
        "from torch import nn\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.conv, self.norm = nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32)\n"
        "    def forward(self, x):\n"
        "        return nn.functional.relu(self.norm(self.conv(x))) + x\n"
        "def make():\n"
        "    return nn.Sequential(\n"
        "        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),\n"
        "        nn.Sequential(Block(), Block(), Block(), Block()),\n"
        "        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))\n"
    )
    return f"{path}:make"


@pytest.fixture(autouse=True)
def _offline(monkeypatch) -> None:
    """No test reaches the Hugging Face Hub: hub ids resolve from the cache or the catalog
    (tests of the download path mock huggingface_hub's download function)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def assert_same_estimate(full, repeated, note: str | None = None) -> None:
    """A block-repeated (estimate, trace) pair equals the full trace's: every peak,
    component and event is the same, and with ``note`` the notes say the blocks were
    repeated and are otherwise the same."""
    from vramplan.trace.repeat import same_events

    (f, tf), (r, tr) = full, repeated
    if note is not None:
        assert [n for n in r.notes if n.startswith(note)], r.notes
        assert [n for n in r.notes if not n.startswith("repeated blocks")] == list(f.notes)
    assert r.peak.allocated_bytes == f.peak.allocated_bytes
    assert r.components == f.components
    assert abs(r.peak.reserved_bytes - f.peak.reserved_bytes) <= 0.005 * f.peak.reserved_bytes
    assert r.phase_peaks == f.phase_peaks
    assert same_events(tr, tf)
    assert tr.op_counts == tf.op_counts and tr.module_kinds == tf.module_kinds


def fsdp_peaks(spec: str, recipe, world: int) -> tuple[int, int]:
    """(our traced peak, PyTorch's FSDPMemTracker peak) of one rank of ``world`` under
    FSDP2: the tracker runs the same sharded model on fake tensors and a fake process group
    for two steps, as ``trace_training`` does."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard

    from vramplan.distributed.fsdp import Fsdp2, fake_process_group
    from vramplan.sources import resolve
    from vramplan.sources.blocks import repeated_blocks
    from vramplan.trace.policy import CpuPolicy
    from vramplan.trace.step import trace_training
    from vramplan.trace.summary import summarize_trace

    trace = trace_training(resolve(spec, recipe), recipe, CpuPolicy(), Fsdp2(world))
    ours = summarize_trace(trace).peak.allocated_bytes
    built = resolve(spec, recipe)
    model = built.model
    with fake_process_group(world) as mesh:
        for block in repeated_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            model._get_fsdp_state()._lazy_init()
            optimizer = torch.optim.AdamW(model.parameters())
            batch = built.make_batch(recipe.batch_size, torch.float32)
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((batch,))
            with tracker:
                for _ in range(2):
                    built.run(model, batch, True).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    tracker.reset_mod_stats()  # its per-module stats; the peak is kept
            theirs = max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    return ours, theirs


def plan_bench(spec: str, repeat: bool = True, builds: list | None = None) -> Workbench:
    """A workbench on an A100-80GB that shares short traces as plan's does, its builds
    repeating blocks or not (``repeat``), each build's recipe noted in ``builds``."""

    def build(name: str, recipe: Recipe) -> BuiltModel:
        if builds is not None:
            builds.append(recipe)
        built = resolve(name, recipe)
        built.repeat_blocks = repeat
        return built

    bench = Workbench(spec, device_options(gpu="a100-80gb"), build=build)
    bench.shares_short_traces = True
    return bench


def hf_builder(tmp_path: Path, config: dict, recipe: Recipe) -> Callable[[], BuiltModel]:
    """A fresh build of the transformers ``config`` (written under ``tmp_path``) per call:
    the copied-iteration and copied-micro-step tests trace one model twice."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return lambda: resolve(f"hf:{path}", recipe)


class Remembering(nn.Module):
    """Keeps its last output until the next forward pass, which frees it: a storage of one
    pass that the next one frees."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.last = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        self.last = y.detach()
        return y


def meta_built(module_type: type[nn.Module]) -> BuiltModel:
    """``module_type()`` built on the meta device, fed ``(batch, 64)`` inputs, its loss the
    output's sum."""
    with torch.device("meta"):
        model = module_type()
    return BuiltModel(
        f"custom:{module_type.__name__.lower()}",
        module_type.__name__,
        "custom",
        model,
        make_batch=lambda n, dtype: torch.randn(n, 64, dtype=dtype),
        run=lambda m, x, training: m(x).sum(),
    )
