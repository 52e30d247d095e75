"""The bad-input matrix: every command and every source, fed what a user can get wrong.

Each case must end with exit code 2, exactly one line on stderr (``vramplan: error: ...``),
no traceback, nothing on stdout under ``--json``, and every input file byte for byte as it
was. Most cases run in-process (``run_cli``); a few run the installed command end to end.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TINY_GPT2 = {  # the tiny GPT-2 of conftest.py: two blocks of width 32
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 512,
    "n_positions": 64,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
}
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}

# Configs that make no model: (file stem, config, what the message must name).
BAD_CONFIGS = {
    "gpt2_width_0": ({**TINY_GPT2, "n_embd": 0}, "n_embd must be a positive integer"),
    "gpt2_width_string": ({**TINY_GPT2, "n_embd": "32"}, "n_embd must be a positive integer"),
    "gpt2_heads_3": ({**TINY_GPT2, "n_head": 3}, "n_head 3 does not divide n_embd 32"),
    "gpt2_only_type": ({"model_type": "gpt2"}, "does not give the model's size"),
    "llama_only_type": ({"model_type": "llama"}, "does not give the model's size"),
    "llama_hidden_0": ({**LLAMA, "hidden_size": 0}, "hidden_size must be a positive integer"),
    "llama_heads_0": (
        {**LLAMA, "num_attention_heads": 0},
        "num_attention_heads must be a positive integer",
    ),
    "llama_hidden_word": ({**LLAMA, "hidden_size": "big"}, "hidden_size"),
    "gpt2_layers_negative": ({**TINY_GPT2, "n_layer": -1}, "n_layer must be a positive"),
    "gpt2_vocab_0": ({**TINY_GPT2, "vocab_size": 0}, "vocab_size must be a positive"),
    "gpt2_layers_float": ({**TINY_GPT2, "n_layer": 1.5}, "n_layer must be a positive"),
    "gpt2_layers_bool": ({**TINY_GPT2, "n_layer": True}, "n_layer must be a positive"),
    "gpt2_heads_null": ({**TINY_GPT2, "n_head": None}, "n_head must be a positive"),
    "llama_kv_3": ({**LLAMA, "num_key_value_heads": 3}, "num_key_value_heads 3 does not"),
    "llama_intermediate_0": ({**LLAMA, "intermediate_size": 0}, "intermediate_size"),
    "gpt2_positions_0": ({**TINY_GPT2, "n_positions": 0}, "n_positions must be a positive"),
    "gpt2_layers_huge": ({**TINY_GPT2, "n_layer": 10**6}, "n_layer 1,000,000 is more than"),
    "gpt2_width_huge": ({**TINY_GPT2, "n_embd": 2**40}, "larger than any model's"),
    "no_model_type": ({k: v for k, v in TINY_GPT2.items() if k != "model_type"}, "model_type"),
    "model_type_number": ({**TINY_GPT2, "model_type": 7}, "model_type must be a string"),
    "gpt2_dropout_word": ({**TINY_GPT2, "attn_pdrop": "high"}, "attn_pdrop must be a number"),
    "gpt2_dropout_2": ({**TINY_GPT2, "resid_pdrop": 2.0}, "resid_pdrop must be in [0, 1)"),
    "gpt2_architectures_string": (
        {**TINY_GPT2, "architectures": "GPT2LMHeadModel"},
        "architectures must be a list",
    ),
}
RAW_CONFIGS = {  # not JSON objects at all
    "broken_json": ("{ not json", "malformed config JSON"),
    "array_json": ("[1, 2, 3]", "expected an object"),
    "empty_json": ("", "malformed config JSON"),
}

MODELS_PY = """\
import sys, time, torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
    def forward(self, x):
        return nn.functional.relu(self.norm(self.conv(x))) + x

def cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                         nn.Sequential(Block(), Block()),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

class _Wrap(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.lin, self.body = nn.Linear(8, 8), body
    def forward(self, x):
        return self.body(self, x)

def data_dependent():
    return _Wrap(lambda m, x: m.lin(x) if x.sum() > 0 else x)
def item():
    return _Wrap(lambda m, x: m.lin(x) * x.mean().item())
def nonzero():
    return _Wrap(lambda m, x: m.lin(x)[x.nonzero()[:, 0]])
def to_cuda_in_forward():
    return _Wrap(lambda m, x: m.lin(x.cuda()))
def shape_mismatch():
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(9, 2))
def hangs_in_forward():
    def forever(m, x):
        while True:
            pass
    return _Wrap(forever)

class Identity(nn.Module):
    def forward(self, x):
        return x
def no_layers():
    return Identity()

def needs_cuda():
    if not torch.cuda.is_available():
        raise RuntimeError("this model needs a GPU")
    return mlp()
def cuda_factory():
    return nn.Linear(8, 8).cuda()
def raises():
    raise ValueError("boom")
def returns_int():
    return 42
def returns_none():
    return None
def returns_class():
    return nn.Linear
def returns_tuple():
    return (mlp(), mlp())
def exits():
    sys.exit(3)
def recursion():
    return recursion()
def sleeps():
    time.sleep(60)
    return mlp()
def swallows():
    try:
        time.sleep(60)
    except Exception:
        pass
    return mlp()
def needs_argument(width):
    return nn.Linear(width, width)
not_callable = 5
"""

USER_FILES = {
    "syntax.py": "def f(:\n",
    "import_raises.py": "raise RuntimeError('at import')\n",
    "import_exits.py": "import sys\nsys.exit(0)\n",
    "import_missing.py": "import vramplan_no_such_dependency\n",
}

LAYER_SPECS = {
    "broken.yaml": ("input: [3, 32\nlayers: [", "malformed layer spec"),
    "broken.json": ('{"input": [3, 32, 32], "layers": [', "malformed layer spec"),
    "list.yaml": ("- conv\n- pool\n", "needs an 'input' shape"),
    "no_layers.yaml": ("input: [3, 32, 32]\n", "needs an 'input' shape"),
    "empty.yaml": ("", "needs an 'input' shape"),
    "input_zero.yaml": ("input: [3, 0, 32]\nlayers: [relu]\n", "spec input must be"),
    "input_word.yaml": ("input: three\nlayers: [relu]\n", "spec input must be"),
    "unknown_type.yaml": ("input: [3, 32, 32]\nlayers: [transformerz]\n", "unknown layer type"),
    "negative_out.yaml": (
        "input: [3, 32, 32]\nlayers:\n  - conv: {out: -4, kernel: 3}\n",
        "positive integer 'out'",
    ),
    "kernel_too_big.yaml": (
        "input: [3, 4, 4]\nlayers:\n  - conv: {out: 8, kernel: 9, padding: 0}\n",
        "does not fit",
    ),
    "settings_list.yaml": ("input: [3, 32, 32]\nlayers:\n  - conv: [1, 2]\n", "cannot read layer"),
    "settings_number.yaml": ("input: [3, 32, 32]\nlayers:\n  - conv: 5\n", "cannot read layer"),
    "out_bool.yaml": (
        "input: [3, 32, 32]\nlayers:\n  - conv: {out: true, kernel: 3}\n",
        "positive integer 'out'",
    ),
    "heads.yaml": (
        "input: [10]\nlayers:\n  - embedding: {vocab: 100, dim: 30}\n  - attention: {heads: 4}\n",
        "heads do not divide",
    ),
    "embedding_on_image.yaml": (
        "input: [3, 32, 32]\nlayers:\n  - embedding: {vocab: 10, dim: 8}\n",
        "needs token ids",
    ),
    "activation.yaml": (
        "input: [3, 32, 32]\nlayers:\n  - conv: {out: 8, kernel: 3, activation: swish}\n",
        "unknown fused activation",
    ),
    "spec.toml": ('input = [3, 32, 32]\nlayers = ["relu"]\n', "give a .yaml, .yml or .json"),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Every input file of the matrix, in one folder."""
    root = tmp_path_factory.mktemp("bad-input")
    (root / "tiny.json").write_text(json.dumps(TINY_GPT2))
    (root / "llama.json").write_text(json.dumps(LLAMA))
    for stem, (config, _) in BAD_CONFIGS.items():
        (root / f"{stem}.json").write_text(json.dumps(config))
    for stem, (text, _) in RAW_CONFIGS.items():
        (root / f"{stem}.json").write_text(text)
    (root / "models.py").write_text(MODELS_PY)
    for name, text in USER_FILES.items():
        (root / name).write_text(text)
    for name, (text, _) in LAYER_SPECS.items():
        (root / name).write_text(text)
    (root / "empty_folder").mkdir()
    (root / "bert.json").write_text(
        json.dumps(
            {
                "model_type": "bert",
                "architectures": ["BertForMaskedLM"],
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "intermediate_size": 64,
                "vocab_size": 512,
            }
        )
    )
    return root


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


T = "hf:{d}/tiny.json"
M = "{d}/models.py"
CARD = ["--gpu", "t4"]

CASES: list[tuple[str, list[str], str | None]] = []


def case(name: str, args: list[str], expected: str | None = None) -> None:
    CASES.append((name, args, expected))


# -- configs, in every command that reads one -------------------------------------------------
TRACING = {
    "estimate": [],
    "max-batch": CARD,
    "plan": CARD,
    "measure": ["--device", "cpu"],
}
for stem, (_, expected) in {**BAD_CONFIGS, **RAW_CONFIGS}.items():
    for command, extra in {**TRACING, "llm": []}.items():
        case(f"{command}-config-{stem}", [command, f"hf:{{d}}/{stem}.json", *extra], expected)
for command, extra in {**TRACING, "llm": []}.items():
    case(
        f"{command}-folder-without-config",
        [command, "hf:{d}/empty_folder", *extra],
        "no config.json",
    )
    case(f"{command}-config-missing", [command, "hf:{d}/missing.json", *extra], "not found")
    case(f"{command}-hf-unknown", [command, "hf:not-a-model", *extra], "unknown hf model")

# -- recipe and device flags -----------------------------------------------------------------
FLAGS = [
    ("gpu-memory-bare", ["--gpu-memory", "24"], "did you mean 24GiB?"),
    ("gpu-memory-zero", ["--gpu-memory", "0GiB"], "must be positive"),
    ("gpu-memory-negative", ["--gpu-memory", "-1GiB"], "must be positive"),
    ("gpu-memory-word", ["--gpu-memory", "lots"], "cannot read GPU memory"),
    ("gpu-memory-empty", ["--gpu-memory", ""], "--gpu-memory is empty"),
    ("gpu-memory-bytes", ["--gpu-memory", "24B"], "between 256MiB"),
    ("gpu-memory-huge", ["--gpu-memory", "1e9TiB"], "between 256MiB"),
    ("gpu-memory-unit", ["--gpu-memory", "24XB"], "cannot read GPU memory"),
    ("gpu-empty", ["--gpu", ""], "--gpu is empty"),
    ("gpu-blank", ["--gpu", "  "], "--gpu is empty"),
    ("gpu-unknown", ["--gpu", "rtx9999"], "unknown GPU"),
    ("gpu-and-memory", ["--gpu", "t4", "--gpu-memory", "24GiB"], "not both"),
    ("shape-trailing-x", ["--input-shape", "3x224x224x"], "a size is missing"),
    ("shape-double-x", ["--input-shape", "3xx224"], "a size is missing"),
    ("shape-only-x", ["--input-shape", "x"], "shape"),
    ("shape-zero", ["--input-shape", "0x3"], "positive integer"),
    ("shape-word", ["--input-shape", "3xAx4"], "cannot read shape"),
    ("shape-empty", ["--input-shape", ""], "shape"),
    ("shape-negative", ["--input-shape", "-3x4"], "shape"),
    ("batch-zero", ["--batch-size", "0"], "batch size must be a positive integer"),
    ("batch-negative", ["--batch-size", "-2"], "batch size must be a positive integer"),
    ("batch-word", ["--batch-size", "many"], "--batch-size"),
    ("batch-float", ["--batch-size", "1.5"], "--batch-size"),
    ("seq-zero", ["--seq-len", "0"], "sequence length must be a positive integer"),
    ("seq-too-long", ["--seq-len", "100000"], "64 learned positions"),
    ("precision", ["--precision", "fp8"], "unknown precision"),
    ("optimizer", ["--optimizer", "adamm"], "unknown optimizer"),
    ("optimizer-impl", ["--optimizer-impl", "vectorised"], "unknown optimizer implementation"),
    ("fused-lion", ["--optimizer", "lion", "--optimizer-impl", "fused"], "torch.optim"),
    ("checkpointing-negative", ["--checkpointing", "-1"], "checkpointing"),
    ("checkpointing-word", ["--checkpointing", "half"], "checkpointing"),
    ("checkpointing-beyond", ["--checkpointing", "1000"], "has 2 repeated blocks"),
    ("checkpointing-infer", ["--checkpointing", "full", "--mode", "infer"], "no backward"),
    ("mode", ["--mode", "eval"], "unknown mode"),
    ("grad-accum", ["--grad-accum", "0"], "gradient accumulation"),
    ("headroom-high", ["--headroom", "1.5"], "headroom"),
    ("headroom-negative", ["--headroom", "-0.1"], "headroom"),
    ("alloc-conf-option", ["--alloc-conf", "bogus:1"], "alloc conf"),
    ("alloc-conf-value", ["--alloc-conf", "expandable_segments:maybe"], "alloc conf"),
    ("units", ["--units", "metric"], "unknown units"),
    ("timeout-zero", ["--timeout", "0"], "timeout must be a positive"),
    ("timeout-negative", ["--timeout", "-5"], "timeout must be a positive"),
    ("unknown-flag", ["--bogus-flag"], "No such option"),
    ("boxes-negative", ["--boxes-per-image", "-1"], "boxes per image must be a whole number"),
    ("boxes-word", ["--boxes-per-image", "many"], "--boxes-per-image"),
    ("busiest-zero", ["--busiest-image-boxes", "0"], "--busiest-image-boxes must be a positive"),
    ("detection-counts", ["--detection-counts", "typical"], "unknown detection count policy"),
    ("targets-on-gpu", ["--targets-on-gpu", "polygons"], "unknown targets on the GPU"),
    ("resolution-zero", ["--resolution", "0"], "resolution must be a positive integer"),
    ("frames-negative", ["--frames", "-2"], "frames must be a positive integer"),
    ("diffusion-encoders", ["--diffusion-encoders", "cached"], "unknown diffusion encoders"),
]
for name, flags, expected in FLAGS:
    case(f"estimate-{name}", ["estimate", T, *flags], expected)
ESTIMATE_ONLY = [
    ("target", ["--target", "tpu"], "unknown target"),
    ("framework", ["--framework", "jax"], "unknown framework"),
    ("profile-missing", ["--profile", "{d}/missing-profile.json"], "profile not found"),
    ("stack", ["--stack", "nonsense"], "stack"),
    ("used-counter", ["--used-counter", "nvml-v3"], "used counter"),
    ("zero-grad", ["--zero-grad", "sometimes"], "unknown zero_grad"),
    ("html-folder-missing", ["--html", "{d}/no/such/folder/r.html"], "does not exist"),
    ("html-over-config", ["--html", "{d}/tiny.json"], "never replaces a .json file"),
    ("html-folder", ["--html", "{d}/empty_folder"], "needs a file path"),
    ("plot-over-model", ["--plot", "{d}/models.py"], "never replaces a .py file"),
    ("plot-folder-missing", ["--plot", "{d}/no/p.png"], "does not exist"),
    ("fsdp-zero", ["--fsdp", "0"], "at least 1"),
    ("world-size-zero", ["--world-size", "0"], "at least 1"),
    ("shard", ["--world-size", "2", "--shard", "weird"], "unknown --shard"),
    ("zero-stage", ["--zero", "4", "--dp", "2"], "ZeRO stage"),
    ("zero-dp-zero", ["--zero", "1", "--dp", "0"], "at least 1"),
    ("fsdp-and-zero", ["--fsdp", "2", "--zero", "1"], "choose one of"),
    ("offload-alone", ["--offload-optimizer"], "go with --zero"),
    ("tp-zero", ["--tp", "0"], "at least 1"),
    ("tp-not-dividing", ["--tp", "3"], "does not divide the 2 attention heads"),
    ("pp-zero", ["--pp", "0"], "at least 1"),
    ("pp-beyond-layers", ["--pp", "5"], "larger than the 2 layers"),
    ("microbatches-zero", ["--pp", "2", "--microbatches", "0"], "at least 1"),
    ("sp-without-tp", ["--sp"], "--sp needs --tp"),
    ("shard-without-world-size", ["--shard", "grad-op"], "goes with --world-size"),
    ("shard-with-fsdp", ["--fsdp", "2", "--shard", "none"], "goes with --world-size"),
    ("reshard-alone", ["--no-reshard-after-forward"], "goes with --fsdp N"),
    ("fsdp-version-alone", ["--fsdp-version", "1"], "goes with FSDP sharding"),
    # TensorFlow's runtime (device/tensorflow.py)
    ("tf-growth-alone", ["--tf-memory-growth"], "need --framework tensorflow"),
    ("tf-limit-alone", ["--tf-memory-limit", "8GiB"], "need --framework tensorflow"),
    ("tf-limit-word", ["--framework", "tensorflow", "--tf-memory-limit", "lots"], "memory limit"),
    ("tf-limit-bare", ["--framework", "tensorflow", "--tf-memory-limit", "8"], "did you mean 8GiB"),
    ("tf-target-cpu", ["--framework", "tensorflow", "--target", "cpu"], "models a GPU"),
]
for name, flags, expected in ESTIMATE_ONLY:
    case(f"estimate-{name}", ["estimate", T, *flags], expected)
# max-batch and plan take TensorFlow's runtime too (issue 20), and the parallel layout
LAYOUT_CASES = ("fsdp", "world", "shard", "reshard", "zero", "tp", "pp", "microbatches", "sp")
for command in ("max-batch", "plan"):
    for name, flags, expected in ESTIMATE_ONLY:
        if name.startswith("tf-limit") or name in ("tf-growth-alone", "framework"):
            case(f"{command}-{name}", [command, T, *CARD, *flags], expected)
        layout = name.startswith(LAYOUT_CASES) and name != "zero-grad"
        if layout or (command == "max-batch" and name == "offload-alone"):
            case(f"{command}-{name}", [command, T, *CARD, *flags], expected)
    case(
        f"{command}-layout-tensorflow",
        [command, T, *CARD, "--fsdp", "2", "--framework", "tensorflow"],
        "judged on one GPU here",
    )

# -- generation and serving (issue 21) ---------------------------------------------------------
GEN = ["--mode", "generate"]
GENERATION = [
    ("new-tokens-zero", [*GEN, "--new-tokens", "0"], "new tokens must be a positive integer"),
    ("prompt-negative", [*GEN, "--prompt-len", "-3"], "prompt len must be a positive integer"),
    ("beams-zero", [*GEN, "--num-beams", "0"], "beams must be a positive integer"),
    ("cache-unknown", [*GEN, "--cache", "paged"], "unknown cache"),
    ("new-tokens-without-generate", ["--new-tokens", "5"], "need --mode generate"),
    ("generate-too-long", [*GEN, "--prompt-len", "60", "--new-tokens", "10"], "64 learned"),
    ("generate-prompt-and-seq", [*GEN, "--prompt-len", "8", "--seq-len", "9"], "give one"),
]
for name, flags, expected in GENERATION:
    case(f"estimate-{name}", ["estimate", T, *flags], expected)
case("estimate-generate-cnn", ["estimate", f"{M}:cnn", *GEN], "not a causal language model")
case("measure-generate", ["measure", T, *GEN, "--device", "cpu"], "not measured yet")
SERVE = ["serve", T, "--gpu", "h100"]
for name, flags, expected in [
    ("utilization-zero", ["--gpu-memory-utilization", "0"], "must be in (0, 1]"),
    ("max-model-len-zero", ["--max-model-len", "0"], "--max-model-len must be a positive"),
    ("block-size-zero", ["--block-size", "0"], "--block-size must be a positive"),
    ("kv-dtype", ["--kv-cache-dtype", "int3"], "unknown --kv-cache-dtype"),
    ("engine", ["--engine", "sglang"], "unknown engine"),
    ("precision", ["--precision", "fp32"], "choose bf16 or fp16"),
    ("gpu-unknown", ["--gpu", "rtx9999"], "unknown GPU"),
]:
    case(f"serve-{name}", [*SERVE, *flags], expected)
case("serve-without-gpu", ["serve", T], "serve needs --gpu")
case("serve-cnn", ["serve", f"{M}:cnn", "--gpu", "h100"], "not a causal language model")
# -- recipe tricks (trace/tricks.py, sources/loss.py) -------------------------------------------
TRICKS = [
    ("in-backward-accum", ["--optimizer-in-backward", "--grad-accum", "2"], "--grad-accum 1"),
    ("in-backward-infer", ["--optimizer-in-backward", "--mode", "infer"], "--mode infer has none"),
    (
        "in-backward-no-optimizer",
        ["--optimizer-in-backward", "--optimizer", "none"],
        "an optimizer",
    ),
    ("offload-infer", ["--activation-offload", "--mode", "infer"], "--mode infer has none"),
    ("loss-chunks-negative", ["--loss-chunks", "-2"], "non-negative integer"),
    ("loss-chunks-word", ["--loss-chunks", "many"], "--loss-chunks"),
    ("loss-chunks-and-fused", ["--loss-chunks", "4", "--fused-ce"], "choose one of"),
    ("dora-without-lora", ["--dora"], "--dora needs --lora"),
    ("dora-quantized", ["--lora", "4", "--dora", "--quantize", "nf4"], "not modelled"),
    ("paged-typo", ["--optimizer", "paged_adamw_4bit"], "unknown optimizer"),
]
for name, flags, expected in TRICKS:
    case(f"estimate-{name}", ["estimate", T, *flags], expected)
for name in ("in-backward-accum", "loss-chunks-and-fused"):
    flags, expected = next((f, e) for n, f, e in TRICKS if n == name)
    case(f"plan-{name}", ["plan", T, *CARD, *flags], expected)
case("estimate-loss-chunks-on-cnn", ["estimate", f"{M}:cnn", "--loss-chunks", "4"], "causal LM")
case("estimate-fused-ce-on-cnn", ["estimate", f"{M}:cnn", "--fused-ce"], "causal LM")
case("estimate-packing-on-cnn", ["estimate", f"{M}:cnn", "--packing"], "packs token sequences")
case("estimate-quantize-cnn", ["estimate", f"{M}:cnn", "--quantize", "nf4"], "not a transformers")
# -- framework storage (trace/storage.py, sources/loss.py) --------------------------------------
case("estimate-weights-dtype-pure", ["estimate", T, "--weights-dtype", "bf16"], "amp-bf16")
case(
    "estimate-weights-dtype-word",
    ["estimate", T, "--precision", "amp-bf16", "--weights-dtype", "fp8"],
    "unknown weights dtype",
)
case(
    "estimate-keep-fp32-no-match",
    ["estimate", T, "--precision", "bf16", "--keep-fp32", "*nothing_here*"],
    "matches no parameter",
)
case("estimate-loss-shift-copy-on-cnn", ["estimate", f"{M}:cnn", "--loss-shift-copy"], "causal LM")
case("estimate-loss-no-upcast-alone", ["estimate", T, "--loss-no-upcast"], "--loss-shift-copy")
case(
    "estimate-loss-shift-copy-and-chunks",
    ["estimate", T, "--loss-shift-copy", "--loss-chunks", "4"],
    "--loss-shift-copy",
)
for command, extra in (("max-batch", CARD), ("plan", CARD), ("measure", ["--device", "cpu"])):
    for name, flags, expected in FLAGS:
        if name.startswith(("gpu", "headroom")) and command == "measure":
            continue  # measure takes no card
        if name in ("shape-only-x", "shape-empty", "batch-float", "headroom-negative"):
            continue  # the same parser as above; keep the matrix quick
        if name.startswith("gpu"):
            case(f"{command}-{name}", [command, T, *flags], expected)
            continue
        case(f"{command}-{name}", [command, T, *extra, *flags], expected)
case("max-batch-no-card", ["max-batch", T], "needs a card")
case("max-batch-search", ["max-batch", T, *CARD, "--search", "tokens"], "unknown search")
case("plan-host-memory-bare", ["plan", T, *CARD, "--host-memory", "64"], "did you mean 64GiB?")
case("plan-host-memory-word", ["plan", T, *CARD, "--host-memory", "plenty"], "host memory")
case("plan-workers", ["plan", T, *CARD, "--workers", "-1"], "workers")
case("plan-html-folder-missing", ["plan", T, *CARD, "--html", "{d}/no/r.html"], "does not exist")
case("measure-html-over-config", ["measure", T, "--html", "{d}/tiny.json"], "never replaces")
case("measure-steps", ["measure", T, "--device", "cpu", "--steps", "0"], "steps")
case("measure-device", ["measure", T, "--device", "tpu"], "unknown device")
case("measure-cuda-absent", ["measure", T, "--device", "cuda"], "no CUDA device")
case(
    "measure-snapshot-cpu",
    ["measure", T, "--device", "cpu", "--snapshot", "{d}/snap.pickle"],
    "nothing to record with --device cpu",
)

# -- the model and the flags it cannot take -------------------------------------------------
for command, extra in {**TRACING}.items():
    case(
        f"{command}-user-seq-len-on-image",
        [command, f"{M}:cnn", *extra, "--seq-len", "64"],
        "takes no sequence",
    )
    case(
        f"{command}-user-checkpointing-no-blocks",
        [command, f"{M}:mlp", *extra, "--checkpointing", "full"],
        "no repeated blocks",
    )
    case(
        f"{command}-user-checkpointing-beyond",
        [command, f"{M}:cnn", *extra, "--checkpointing", "3"],
        "has 2 repeated blocks",
    )
case(
    "max-batch-search-seq-on-image",
    ["max-batch", f"{M}:cnn", *CARD, "--search", "seq-len"],
    "no sequence length to search",
)
case("estimate-tp-on-cnn", ["estimate", f"{M}:cnn", "--tp", "2"], "this model has none")
case("estimate-pp-on-mlp", ["estimate", f"{M}:mlp", "--pp", "2"], "this model has none")
case(
    "estimate-shape-wrong-rank",
    ["estimate", f"{M}:cnn", "--input-shape", "5"],
    "failed on the example batch",
)
case(
    "estimate-detection-shape-rank",
    ["estimate", "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn", "--input-shape", "224"],
    "detection models take --input-shape CxHxW",
)
case(
    "estimate-diffusion-resolution",
    ["estimate", "diffusers:sd15-unet", "--resolution", "500"],
    "must be a multiple of 8",
)
case("estimate-diffusers-unknown", ["estimate", "diffusers:sd9-unet"], "unknown diffusers model")
case(
    "estimate-diffusion-frozen-sdxl",
    ["estimate", "diffusers:sdxl-unet", "--diffusion-encoders", "frozen"],
    "precompute their embeddings",
)
case(
    "estimate-video-shape", ["estimate", "torchvision:r3d_18", "--input-shape", "3x8x8"], "CxTxHxW"
)
case(
    "estimate-frames-on-image",
    ["estimate", "torchvision:resnet18", "--frames", "4"],
    "--frames applies to video models, not to torchvision:resnet18",
)
case(
    "estimate-boxes-on-diffusion",
    ["estimate", "diffusers:sd15-unet", "--boxes-per-image", "3"],
    "--boxes-per-image applies to detection models",
)
case(
    "estimate-dit-partial-patches",
    ["estimate", "diffusers:dit-xl-2-256", "--resolution", "264"],
    "not whole 2x2 patches of the DiT",
)
case(
    "estimate-mvit-frames",
    ["estimate", "torchvision:mvit_v2_s", "--frames", "4"],
    "exactly 16 frames of 224x224",
)
case("estimate-optical-flow", ["estimate", "torchvision:raft_small"], "optical-flow model")
case("estimate-text-shape-on-lm", ["estimate", T, "--input-shape", "3x224x224"], "text models take")

# -- how a named model is built and fed (--attention, --moe-routing, --experts, ...) ---------
BF16 = ["--precision", "bf16"]
case("estimate-attention-unknown", ["estimate", T, "--attention", "fast"], "unknown attention")
case("estimate-flash-fp32", ["estimate", T, "--attention", "flash_attention_2"], "fp16/bf16 only")
case(
    "estimate-flash-cpu",
    ["estimate", T, "--attention", "flash_attention_2", *BF16, "--target", "cpu"],
    "no CPU kernels",
)
case(
    "estimate-flash-t4",
    ["estimate", T, "--attention", "flash_attention_2", *BF16, "--gpu", "t4"],
    "the card is sm75",
)
case("estimate-flex-gpt2", ["estimate", T, "--attention", "flex_attention"], "does not support")
case("estimate-routing-unknown", ["estimate", T, "--moe-routing", "random"], "unknown MoE routing")
case("estimate-experts-unknown", ["estimate", T, "--experts", "fast"], "unknown experts")
case("estimate-experts-dense", ["estimate", T, "--experts", "eager"], "no mixture of experts")
case("estimate-target-len-0", ["estimate", T, "--target-len", "0"], "--target-len must be")
case("estimate-target-len-lm", ["estimate", T, "--target-len", "8"], "no decoder of its own")
case("estimate-num-classes-lm", ["estimate", T, "--num-classes", "3"], "no classification head")
case(
    "estimate-num-classes-0",
    ["estimate", "torchvision:resnet18", "--num-classes", "0"],
    "--num-classes must be",
)
case(
    "max-batch-attention-unknown", ["max-batch", T, "--attention", "x", *CARD], "unknown attention"
)
case("plan-routing-unknown", ["plan", T, "--moe-routing", "x", *CARD], "unknown MoE routing")

# -- model names and user code --------------------------------------------------------------
SPECS = [
    ("no-prefix", "nonsense", "cannot read model"),
    ("empty-name", "hf:", "cannot read model"),
    ("torchvision-unknown", "torchvision:resnet5O", "unknown torchvision model"),
    ("timm-unknown", "timm:not_a_timm_model", "unknown timm model"),
    ("timm-bad-tag", "timm:resnet50.no_such_tag", "Invalid pretrained tag"),
    ("torchvision-bad-weights", "torchvision:ResNet50_Weights.NOPE", "unknown torchvision weights"),
    ("file-missing", "{d}/missing.py:make", "model file not found"),
    ("module-missing", "vramplan_no_such_module:make", "cannot import module"),
    ("no-factory-name", "{d}/models.py:", "cannot read model"),
    ("no-file-name", ":make", "cannot read model"),
    ("attribute-missing", f"{M}:nope", "has no attribute 'nope'"),
    ("not-callable", f"{M}:not_callable", "is not callable"),
    ("syntax-error", "{d}/syntax.py:f", "SyntaxError"),
    ("import-raises", "{d}/import_raises.py:f", "RuntimeError: at import"),
    ("import-exits", "{d}/import_exits.py:f", "sys.exit(0)"),
    ("import-missing", "{d}/import_missing.py:f", "ModuleNotFoundError"),
    ("factory-raises", f"{M}:raises", "raised ValueError: boom"),
    ("factory-needs-argument", f"{M}:needs_argument", "missing 1 required positional"),
    ("returns-int", f"{M}:returns_int", "did not return an nn.Module (got int)"),
    ("returns-none", f"{M}:returns_none", "got NoneType"),
    ("returns-class", f"{M}:returns_class", "got type"),
    ("returns-tuple", f"{M}:returns_tuple", "got tuple"),
    ("factory-exits", f"{M}:exits", "called sys.exit(3)"),
    ("factory-recursion", f"{M}:recursion", "RecursionError"),
    ("needs-cuda", f"{M}:needs_cuda", "traces on the CPU with fake tensors"),
    ("cuda-factory", f"{M}:cuda_factory", "never uses a GPU"),
    ("cuda-in-forward", f"{M}:to_cuda_in_forward", "never uses a GPU"),
    ("data-dependent-if", f"{M}:data_dependent", "shapes but no values"),
    ("item", f"{M}:item", "shapes but no values"),
    ("nonzero", f"{M}:nonzero", "shapes but no values"),
    ("shape-mismatch", f"{M}:shape_mismatch", "failed on the example batch"),
    ("no-layers", f"{M}:no_layers", "pass --input-shape"),
]
if importlib.util.find_spec("keras") is not None:  # keras: sources (sources/keras_models.py)
    SPECS += [
        ("keras-unknown", "keras:ResNet5", "did you mean ResNet50"),
        ("keras-file-missing", "keras:{d}/missing.keras", "Keras file not found"),
        ("keras-factory-missing", "keras:{d}/missing.py:make", "model file not found"),
        ("keras-factory-not-keras", f"keras:{M}:mlp", "did not give a keras.Model"),
    ]
for name, spec, expected in SPECS:
    case(f"estimate-{name}", ["estimate", spec], expected)
for command, extra in (("max-batch", CARD), ("plan", CARD), ("measure", ["--device", "cpu"])):
    for name, spec, expected in SPECS:
        if name in (
            "syntax-error",
            "factory-raises",
            "returns-none",
            "item",
            "needs-cuda",
            "file-missing",
        ):
            case(f"{command}-{name}", [command, spec, *extra], expected)

# -- the answers without tracing ------------------------------------------------------------
CALC = [
    ("params-fraction", ["--params", "0.5"], "whole number"),
    ("params-zero", ["--params", "0"], "at least 1"),
    ("params-word", ["--params", "lots"], "cannot read parameter count"),
    ("params-negative", ["--params", "-5"], "must not be negative"),
    ("params-suffix", ["--params", "20Q"], "cannot read parameter count"),
    ("params-inf", ["--params", "1e400"], "cannot read parameter count"),
    ("params-missing", [], "--params"),
    ("activations-negative", ["--params", "20M", "--activations-per-sample", "-1"], "negative"),
    ("activations-word", ["--params", "20M", "--activations-per-sample", "x"], "activations"),
    ("method", ["--params", "20M", "--method", "nope"], "unknown method"),
    ("shape", ["--params", "20M", "--input-shape", "3x"], "a size is missing"),
    ("batch", ["--params", "20M", "--batch-size", "0"], "batch size"),
    ("precision", ["--params", "20M", "--precision", "fp4"], "unknown precision"),
    ("optimizer", ["--params", "20M", "--optimizer", "sgdd"], "unknown optimizer"),
]
for name, flags, expected in CALC:
    case(f"calc-{name}", ["calc", *flags], expected)
for name, (_, expected) in LAYER_SPECS.items():
    case(f"layers-{name}", ["layers", f"{{d}}/{name}"], expected)
case("layers-missing", ["layers", "{d}/missing.yaml"], "not found")
case("layers-folder", ["layers", "{d}/empty_folder"], "not found")
case(
    "layers-method", ["layers", str(EXAMPLES / "vgg16.yaml"), "--method", "nope"], "unknown method"
)
case("layers-batch", ["layers", str(EXAMPLES / "vgg16.yaml"), "--batch-size", "0"], "batch size")
LLM = [
    ("not-hf", ["torchvision:resnet50"], "llm takes hf:NAME"),
    ("encoder", ["hf:{d}/bert.json"], "decoder-only"),
    ("attention", [T, "--attention", "weird"], "unknown attention"),
    ("recompute", [T, "--recompute", "weird"], "unknown recompute"),
    ("tp", [T, "--tp", "3"], "must divide"),
    ("tp-zero", [T, "--tp", "0"], "must divide"),
    ("lora-negative", [T, "--lora-rank", "-4"], "LoRA rank must be a positive integer"),
    ("qlora-without-rank", [T, "--qlora"], "--qlora needs --lora-rank"),
    ("seq-zero", [T, "--seq-len", "0"], "sequence length"),
    ("precision", [T, "--precision", "fp8"], "unknown precision"),
    ("mode", [T, "--mode", "serve"], "unknown mode"),
]
for name, args, expected in LLM:
    case(f"llm-{name}", ["llm", *args], expected)
case("gpus-units", ["gpus", "--units", "weird"], "unknown units")
case("gpus-argument", ["gpus", "extra"], "unexpected extra argument")
case("models-source", ["models", "nope"], "unknown source")
case("models-flag", ["models", "hf", "--all"], "No such option")
case("models-search-source", ["models", "bogus", "--search", "llama"], "unknown source")
case("trust-remote-code-value", ["estimate", T, "--trust-remote-code=1"], "does not take a value")
case("hf-hub-id-unknown", ["llm", "hf:acme/no-such-model"], "unknown hf model 'acme/no-such-model'")
case("hf-hub-id-revision", ["llm", "meta-llama/Llama-3.2-3B@nope"], "not in the Hugging Face cache")
case("calibrate-no-gpu", ["calibrate"], "needs a CUDA GPU")
case("calibrate-output", ["calibrate", "--output", "{d}/profiles"], "needs a CUDA GPU")
case("unknown-command", ["estimat", T], "No such command")


def _args(args: list[str], root: Path) -> list[str]:
    return [a.replace("{d}", str(root)) for a in args]


def check_refused(code, out, err, json_output: bool, expected: str | None) -> None:
    assert code == 2, (code, out[-500:], err[-2000:])
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("vramplan: error: "), lines[0]
    if json_output:
        assert out == ""
    if expected is not None:
        assert expected in lines[0], lines[0]


def test_the_matrix_is_large():
    assert len(CASES) >= 150
    assert len({name for name, _, _ in CASES}) == len(CASES)  # each case named once
    commands = {args[0] for _, args, _ in CASES}
    assert commands >= {
        "estimate",
        "max-batch",
        "plan",
        "measure",
        "calc",
        "layers",
        "llm",
        "gpus",
        "models",
        "calibrate",
    }


@pytest.mark.parametrize("args,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_in_one_line(run_cli, inputs, args, expected):
    before = _digest(inputs)
    code, out, err = run_cli(*_args(args, inputs), "--json")
    check_refused(code, out, err, True, expected)
    assert _digest(inputs) == before  # the user's files are never modified
    assert not (inputs / "snap.pickle").exists()


def test_a_factory_that_never_returns_is_stopped(run_cli, inputs):
    code, out, err = run_cli("estimate", f"{inputs}/models.py:sleeps", "--timeout", "1")
    check_refused(code, out, err, False, "factory")
    assert "models.py:sleeps did not return within 1 s" in err


def test_a_factory_that_catches_exceptions_is_still_stopped(run_cli, inputs):
    code, out, err = run_cli("estimate", f"{inputs}/models.py:swallows", "--timeout", "1")
    check_refused(code, out, err, False, "models.py:swallows did not return within 1 s")


def test_a_forward_that_never_returns_is_stopped(run_cli, inputs):
    code, out, err = run_cli("estimate", f"{inputs}/models.py:hangs_in_forward", "--timeout", "1")
    check_refused(code, out, err, False, "the traced step of")


@pytest.mark.parametrize(
    "args,expected",
    [
        (["estimate", "hf:{d}/gpt2_only_type.json"], "does not give the model's size"),
        (["llm", "hf:{d}/llama_heads_0.json", "--json"], "num_attention_heads"),
        (["estimate", "{d}/models.py:item", "--html", "{d}/r.html"], "shapes but no values"),
    ],
)
def test_end_to_end_through_the_installed_command(inputs, args, expected):
    before = _digest(inputs)
    result = subprocess.run(
        [sys.executable, "-m", "vramplan", *_args(args, inputs)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    check_refused(result.returncode, result.stdout, result.stderr, "--json" in args, expected)
    assert _digest(inputs) == before


def test_python_callers_are_pointed_at_example_batch():
    import torch
    from torch import nn

    import vramplan

    model = nn.Sequential(nn.Linear(8, 4))
    with pytest.raises(vramplan.UserError, match="check example_batch"):
        vramplan.estimate(model, example_batch=(torch.randn(2, 5), torch.zeros(2)))
