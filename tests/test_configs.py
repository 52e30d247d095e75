"""Training configs users already have (DeepSpeed, accelerate, torchtune, axolotl,
torchtitan) read into the flags they amount to: every field honoured, noted or listed as
ignored; the same estimate as the flags; bad files refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vramplan
from vramplan.configs import read_config

LLAMA = {  # two blocks of width 32: traces in a second or two
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

DEEPSPEED = {  # as the DeepSpeed tutorials write it, with fields that change no memory
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 50,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.999]}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "reduce_bucket_size": 5e8,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
    "wall_clock_breakdown": False,
}

ACCELERATE_FSDP = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

ACCELERATE_DEEPSPEED = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 4
  offload_optimizer_device: cpu
  offload_param_device: cpu
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
mixed_precision: fp16
num_processes: 4
dynamo_config:
  dynamo_backend: INDUCTOR
"""

TORCHTUNE = """\
# Config for single device LoRA finetuning in lora_finetune_single_device.py
output_dir: /tmp/torchtune/llama3_1_8B/lora_single_device
model:
  _component_: torchtune.models.llama3_1.lora_llama3_1_8b
  lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']
  apply_lora_to_mlp: False
  apply_lora_to_output: False
  lora_rank: 4
  lora_alpha: 8
  lora_dropout: 0.0
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: /tmp/Meta-Llama-3.1-8B-Instruct/original/tokenizer.model
  max_seq_len: 32
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: /tmp/Meta-Llama-3.1-8B-Instruct/
  checkpoint_files: [model-00001-of-00004.safetensors, model-00002-of-00004.safetensors]
  recipe_checkpoint: null
  output_dir: ${output_dir}
  model_type: LLAMA3
resume_from_checkpoint: False
save_adapter_weights_only: False
dataset:
  _component_: torchtune.datasets.alpaca_cleaned_dataset
  packed: False
seed: null
shuffle: True
batch_size: 2
optimizer:
  _component_: torch.optim.AdamW
  fused: True
  weight_decay: 0.01
  lr: 3e-4
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 100
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
epochs: 1
max_steps_per_epoch: null
gradient_accumulation_steps: 2
compile: True
device: cuda
enable_activation_checkpointing: True
enable_activation_offloading: True
dtype: bf16
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${output_dir}/logs
log_every_n_steps: 1
log_peak_memory_stats: True
"""

AXOLOTL = """\
base_model: meta-llama/Meta-Llama-3-8B
model_type: AutoModelForCausalLM
tokenizer_type: AutoTokenizer
load_in_8bit: false
load_in_4bit: true
strict: false
datasets:
  - path: mhenrichsen/alpaca_2k_test
    type: alpaca
dataset_prepared_path:
val_set_size: 0.05
output_dir: ./outputs/qlora-out
adapter: qlora
lora_model_dir:
sequence_len: 4096
sample_packing: true
pad_to_sequence_len: true
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_linear: true
wandb_project:
gradient_accumulation_steps: 4
micro_batch_size: 2
num_epochs: 4
optimizer: paged_adamw_32bit
lr_scheduler: cosine
learning_rate: 0.0002
train_on_inputs: false
bf16: auto
tf32: false
gradient_checkpointing: true
flash_attention: true
warmup_steps: 10
evals_per_epoch: 4
eval_batch_size: 8
saves_per_epoch: 1
weight_decay: 0.0
special_tokens:
  pad_token: "<|end_of_text|>"
"""

TORCHTITAN = """\
# torchtitan Config.toml
[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = true

[model]
name = "llama3"
flavor = "8B"
tokenizer_path = "./assets/tokenizer/original/tokenizer.model"

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0
steps = 1000
compile = true
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = 8
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable_checkpoint = false
folder = "checkpoint"
interval = 500

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"

[float8]
enable_fsdp_float8_all_gather = false
"""


def write(folder: Path, name: str, content) -> Path:
    path = folder / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.fixture
def llama(tmp_path) -> str:
    return f"hf:{write(tmp_path, 'config.json', LLAMA)}"


# -- each reader, on a file written the way its tool's users write it -------------------------


def test_deepspeed(tmp_path):
    config = read_config(write(tmp_path, "ds_config.json", DEEPSPEED))
    assert config.tool == "DeepSpeed" and config.model is None
    assert config.options == {
        "zero": 2,
        "offload_optimizer": True,
        "batch_size": 2,
        "grad_accum": 2,
        "dp": 4,  # 16 = 2 per GPU x 2 accumulated x 4 GPUs
        "precision": "amp-bf16",
        "optimizer": "adamw",
        "checkpointing": "full",
    }
    assert config.layout().describe() == "zero2 dp=4 offload-optimizer"
    for field in ("steps_per_print", "zero_optimization.overlap_comm", "scheduler.*"):
        assert field in config.ignored
    text = "\n".join(config.lines())
    assert "zero_optimization.reduce_bucket_size" in text and "gradient_clipping" in text


def test_accelerate_fsdp(tmp_path):
    config = read_config(write(tmp_path, "fsdp.yaml", ACCELERATE_FSDP))
    assert config.tool == "accelerate"
    assert config.options == {
        "precision": "amp-bf16",
        "fsdp": 8,
        "fsdp_version": 2,
        "checkpointing": "full",
    }
    assert any(n.startswith("fsdp_config.fsdp_cpu_ram_efficient_loading") for n in config.notes)
    assert "fsdp_config.fsdp_state_dict_type" in config.ignored
    assert any("batch size is set in your script" in n for n in config.notes)


def test_accelerate_deepspeed(tmp_path):
    config = read_config(write(tmp_path, "ds.yaml", ACCELERATE_DEEPSPEED))
    assert config.layout().describe() == "zero3 dp=4 offload-optimizer offload-params"
    assert config.options["precision"] == "amp-fp16"
    assert config.options["grad_accum"] == 4
    assert any(n.startswith("dynamo_config") for n in config.notes)
    assert "deepspeed_config.zero3_save_16bit_model" in config.ignored


def test_torchtune(tmp_path):
    config = read_config(write(tmp_path, "lora.yaml", TORCHTUNE))
    assert config.tool == "torchtune" and config.model == "hf:meta-llama-3-8b"
    recipe = config.recipe()
    assert (recipe.batch_size, recipe.seq_len, recipe.grad_accum) == (2, 32, 2)
    assert (recipe.lora_rank, recipe.lora_alpha) == (4, 8.0)
    assert recipe.lora_targets == "q_proj,v_proj,o_proj"  # torchtune's output_proj
    assert (recipe.precision, recipe.checkpointing) == ("bf16", "full")
    assert recipe.compile  # compile: True, traced as torchtune compiles (trace/compiled.py)
    # the memory savers vramplan traces become their flags
    assert (recipe.activation_offload, recipe.loss_chunks) == (True, 8)
    honoured = " ".join(config.honoured)
    for field in ("enable_activation_offloading", "loss._component_"):
        assert field in honoured and field not in " ".join(config.notes)
    assert "checkpointer.*" in config.ignored and "metric_logger.*" in config.ignored


def test_qlora_torchtune_builder_quantizes(tmp_path):
    text = TORCHTUNE.replace("lora_llama3_1_8b", "qlora_llama3_1_8b")
    recipe = read_config(write(tmp_path, "qlora.yaml", text)).recipe()
    assert (recipe.quantize, recipe.lora_rank) == ("nf4", 4)


def test_axolotl(tmp_path):
    config = read_config(write(tmp_path, "qlora.yml", AXOLOTL))
    assert config.tool == "axolotl" and config.model == "hf:meta-llama/Meta-Llama-3-8B"
    recipe = config.recipe()
    assert (recipe.quantize, recipe.double_quant, recipe.lora_rank) == ("nf4", True, 32)
    assert recipe.lora_targets == "all-linear"
    assert (recipe.batch_size, recipe.grad_accum, recipe.seq_len) == (2, 4, 4096)
    assert (recipe.precision, recipe.optimizer, recipe.checkpointing) == (
        "amp-bf16",
        "adamw",
        "full",
    )
    notes = " ".join(config.notes)
    assert "paged" in " ".join(config.honoured)
    assert "sample_packing" in notes and "eval_batch_size" in notes
    assert "flash_attention" in config.ignored and "datasets" in config.ignored


def test_torchtitan(tmp_path):
    config = read_config(write(tmp_path, "llama3_8b.toml", TORCHTITAN))
    assert config.tool == "torchtitan" and config.model == "hf:meta-llama-3-8b"
    recipe = config.recipe()
    assert (recipe.batch_size, recipe.seq_len, recipe.precision) == (1, 8192, "amp-bf16")
    assert recipe.checkpointing == "op"
    assert config.layout().describe() == "fsdp dp=8"
    assert any(n.startswith("training.compile") for n in config.notes)
    assert "profiling.*" in config.ignored and "job.*" in config.ignored


def test_torchtitan_layer_selective_and_defaults(tmp_path):
    text = TORCHTITAN.replace('selective_ac_option = "op"', 'selective_ac_option = "2"')
    text = text.replace("local_batch_size = 1\n", "")
    config = read_config(write(tmp_path, "t.toml", text))
    assert config.options["checkpointing"] == "every:2"
    assert config.options["batch_size"] == 8  # torchtitan's default, listed as such
    assert any("local_batch_size (torchtitan's default)" in h for h in config.honoured)


def test_flags_override_the_config(tmp_path):
    config = read_config(write(tmp_path, "ds_config.json", DEEPSPEED))
    changed = config.with_flags(batch_size=8, fsdp=2)
    assert changed.recipe().batch_size == 8  # train_batch_size no longer binds
    assert changed.layout().describe() == "fsdp dp=2"  # the flag's scheme replaces ZeRO
    assert changed.overridden == ("--batch-size",)


# -- the same workload as flags and as a config gives the same estimate ------------------------


def same(a, b) -> None:
    assert a["peak"] == b["peak"]
    assert a["components"] == b["components"]
    assert a["recipe"] == b["recipe"]


def test_deepspeed_json_gives_the_flags_estimate(run_cli, tmp_path, llama):
    ds = write(tmp_path, "ds_config.json", DEEPSPEED)
    common = ["--seq-len", "32", "--gpu", "t4", "--json"]
    code, out, _ = run_cli("estimate", llama, "--config", str(ds), *common)
    assert code == 0
    from_config = json.loads(out)
    flags = "--batch-size 2 --grad-accum 2 --precision amp-bf16 --optimizer adamw "
    flags += "--checkpointing full --zero 2 --dp 4 --offload-optimizer"
    code, out, _ = run_cli("estimate", llama, *flags.split(), *common)
    same(from_config, json.loads(out))
    assert any("train_batch_size → --dp 4" in n for n in from_config["notes"])
    assert any("steps_per_print" in n for n in from_config["notes"])


def test_torchtune_recipe_gives_the_flags_estimate(tmp_path, llama):
    config = read_config(write(tmp_path, "lora.yaml", TORCHTUNE)).with_flags(model=llama)
    session = vramplan.Session(config.model, gpu="t4")
    from_config = session.estimate(config.recipe(), layout=config.layout()).to_json()
    flags = vramplan.Recipe(
        batch_size=2,
        seq_len=32,
        grad_accum=2,
        precision="bf16",
        checkpointing="full",
        lora_rank=4,
        lora_alpha=8,
        lora_targets="q_proj,v_proj,o_proj",
        compile=True,
        activation_offload=True,
        loss_chunks=8,
        repeat_kv=True,
    )
    same(from_config, vramplan.Session(llama, gpu="t4").estimate(flags).to_json())


# -- check: one line, exit 0 or 3 --------------------------------------------------------------


def test_check_exits_0_when_it_fits_and_3_when_not(run_cli, tmp_path, llama):
    ds = str(write(tmp_path, "ds_config.json", DEEPSPEED))
    code, out, _ = run_cli("check", llama, "--config", ds, "--seq-len", "32", "--gpu", "t4")
    assert code == 0 and out.startswith("FITS: ") and len(out.strip().splitlines()) == 1
    code, out, _ = run_cli(
        "check", llama, "--config", ds, "--seq-len", "32", "--gpu-memory", "300MiB", "--json"
    )
    answer = json.loads(out)
    assert code == 3 and answer["fits"] is False and answer["exit_code"] == 3
    assert answer["verdict"]["compared_bytes"] > answer["verdict"]["usable_bytes"]
    assert any("DeepSpeed" in line for line in answer["config"])


# -- bad configs: one line, exit 2 -------------------------------------------------------------

BAD = {
    "malformed.json": ('{"train_batch_size": 8,', "malformed JSON"),
    "malformed.yaml": ("model: [unclosed\n", "malformed YAML"),
    "malformed.toml": ("[training\nseq_len = 1\n", "malformed TOML"),
    "list.yaml": ("- a\n- b\n", "expected a mapping"),
    "unknown.yaml": ("learning_rate: 1e-4\n", "cannot tell which tool"),
    "not_deepspeed.json": ('{"lr": 1}', "not a DeepSpeed config"),
    "total.json": (
        {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
        "not a multiple",
    ),
    "both_halves.json": (
        {"bf16": {"enabled": True}, "fp16": {"enabled": True}},
        "both bf16 and fp16",
    ),
    "offload_param.json": (
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        "needs stage 3",
    ),
    "stage.json": ({"zero_optimization": {"stage": 4}}, "must be 0, 1, 2 or 3"),
    "fp16_tune.yaml": (TORCHTUNE.replace("dtype: bf16", "dtype: fp16"), "no fp16 training"),
    "qlora_no4bit.yml": (AXOLOTL.replace("load_in_4bit: true", "load_in_4bit: false"), "qlora"),
    "ac.toml": (TORCHTITAN.replace('"op"', '"sometimes"'), "selective_ac_option"),
    "accel.yaml": ("distributed_type: WARP_DRIVE\n", "distributed_type"),
    "text.txt": ("batch_size: 2\n", "give a .json"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_configs_are_refused_in_one_line(run_cli, tmp_path, llama, name):
    content, expected = BAD[name]
    path = write(tmp_path, name, content)
    before = path.read_bytes()
    code, out, err = run_cli("estimate", llama, "--config", str(path), "--json")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vramplan: error: "), err
    assert expected in lines[0]
    assert path.read_bytes() == before


def test_a_config_without_a_model_needs_one(run_cli, tmp_path):
    ds = write(tmp_path, "ds_config.json", DEEPSPEED)
    code, _, err = run_cli("estimate", "--config", str(ds))
    assert code == 2 and "names no model" in err
    code, _, err = run_cli("estimate")
    assert code == 2 and "give a MODEL" in err


def test_a_gpu_count_that_breaks_the_total_batch_is_refused(run_cli, tmp_path, llama):
    ds = write(tmp_path, "ds_config.json", DEEPSPEED)  # 16 = 2 per GPU x 2 accumulated x 4
    assert read_config(ds).with_flags(grad_accum=8).recipe().grad_accum == 8  # a what-if
    code, out, err = run_cli("estimate", llama, "--config", str(ds), "--dp", "2", "--json")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "train_batch_size 16 is not micro-batch 2 × accumulation 2 × 2 GPUs" in err


# -- torchtitan's selective checkpointing, from the flags ---------------------------------------


def test_selective_checkpointing_modes(tmp_path):
    path = write(tmp_path, "config.json", {**LLAMA, "num_hidden_layers": 4})
    session = vramplan.Session(f"hf:{path}", gpu="t4")
    saved = {
        mode: session.estimate(
            batch_size=4, seq_len=64, precision="amp-bf16", checkpointing=mode
        ).components["activations"]
        for mode in ("none", "op", "full", "every:2", "2")
    }
    # the op policy keeps matmul and attention outputs: between keeping all and keeping none
    assert saved["none"] > saved["op"] > saved["full"]
    # every second of four identical blocks recomputes as many blocks as the first two do
    assert saved["every:2"] == saved["2"] < saved["none"]
    assert vramplan.Recipe(checkpointing="every:1").checkpointing == "full"
    with pytest.raises(vramplan.UserError, match="every:N"):
        vramplan.Recipe(checkpointing="every:0")


def test_torchtune_repeats_kv_for_its_grouped_query_builders(tmp_path):
    """torchtune's MultiHeadAttention repeats K and V before SDPA: the recipe of a builder
    whose bundled config has fewer key/value heads than query heads asks for --repeat-kv,
    Llama 2's (as many of each) does not."""
    from vramplan.configs.torchtune import GROUPED_QUERY, MODELS
    from vramplan.sources.configs import load_config_dict

    for builder, name in MODELS.items():
        _, config = load_config_dict(name)
        grouped = config["num_key_value_heads"] < config["num_attention_heads"]
        assert (builder in GROUPED_QUERY) == grouped, builder
    assert read_config(write(tmp_path, "lora.yaml", TORCHTUNE)).recipe().repeat_kv
    llama2 = TORCHTUNE.replace("lora_llama3_1_8b", "lora_llama2_7b")
    assert not read_config(write(tmp_path, "llama2.yaml", llama2)).recipe().repeat_kv
