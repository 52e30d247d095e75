"""The Trainer integration: a Trainer is estimated as the same workload given as flags,
and the batch it is given is the largest that fits, with no real step run."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import vramplan

transformers = pytest.importorskip("transformers")

from vramplan.integrations.transformers import (  # noqa: E402
    estimate_evaluation,
    estimate_trainer,
    fit_batch_size,
    training_args_config,
)

TINY = dict(  # two blocks of width 64 over a 4096-token vocabulary
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
SEQ = 128


@pytest.fixture
def llama_config(tmp_path):
    path = tmp_path / "config.json"
    # the Trainer sets use_cache=False on the model it trains; the config file says so too
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **TINY}
    config["use_cache"] = False
    path.write_text(json.dumps(config))
    return path


def trainer_for(tmp_path, **args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
        arguments = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **args
        )
    sample = {"input_ids": torch.zeros(SEQ, dtype=torch.long)}
    sample["labels"] = sample["input_ids"]
    return transformers.Trainer(model=model, args=arguments, train_dataset=[sample] * 64)


def test_training_arguments_are_read(tmp_path):
    trainer = trainer_for(
        tmp_path,
        per_device_train_batch_size=3,
        gradient_accumulation_steps=4,
        bf16=True,
        gradient_checkpointing=True,
        optim="adamw_bnb_8bit",
        torch_compile=False,
        seed=7,
        per_device_eval_batch_size=16,
    )
    config = training_args_config(trainer.args, seq_len=SEQ)
    recipe = config.recipe()
    assert (recipe.batch_size, recipe.grad_accum, recipe.seq_len) == (3, 4, SEQ)
    assert (recipe.precision, recipe.checkpointing, recipe.optimizer) == (
        "amp-bf16",
        "full",
        "adam8bit",
    )
    assert "seed" in config.ignored  # changed from its default, not modelled: named
    assert any(n.startswith("per_device_eval_batch_size") for n in config.notes)


def test_a_trainer_gives_the_flags_estimate(tmp_path, llama_config):
    trainer = trainer_for(
        tmp_path,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        bf16=True,
        gradient_checkpointing=True,
    )
    from_trainer = estimate_trainer(trainer, seq_len=SEQ, gpu="t4").to_json()
    flags = vramplan.Recipe(
        batch_size=2, seq_len=SEQ, grad_accum=2, precision="amp-bf16", checkpointing="full"
    )
    from_flags = vramplan.Session(f"hf:{llama_config}", gpu="t4").estimate(flags).to_json()
    assert from_trainer["peak"] == from_flags["peak"]
    assert from_trainer["components"] == from_flags["components"]
    # the user's model was traced on a meta copy: its weights are untouched and real
    assert all(p.device.type == "cpu" for p in trainer.model.parameters())


def test_evaluation_is_a_no_grad_step_at_the_eval_batch(tmp_path):
    trainer = trainer_for(tmp_path, per_device_eval_batch_size=4, bf16=True)
    est = estimate_evaluation(trainer.model, trainer.args, seq_len=SEQ, gpu="t4")
    assert (est.recipe.mode, est.recipe.batch_size, est.recipe.optimizer) == (
        "infer",
        4,
        "none",
    )
    assert est.components["gradients"] == 0


def test_the_trainer_gets_the_largest_batch_that_fits(tmp_path, llama_config, run_cli):
    trainer = trainer_for(tmp_path, per_device_train_batch_size=1, bf16=True)
    card = ["--gpu-memory", "900MiB", "--headroom", "0"]
    answer = fit_batch_size(trainer, seq_len=SEQ, gpu_memory="900MiB", headroom=0.0)
    batch = answer.value
    assert batch > 1
    assert trainer.args.per_device_train_batch_size == batch
    assert trainer.get_train_dataloader().batch_sampler.batch_size == batch  # what train() uses
    flags = ["--seq-len", str(SEQ), "--precision", "amp-bf16", *card, "--json"]
    for size, status in ((batch, "fits"), (batch + 1, "tight")):
        code, out, _ = run_cli("estimate", f"hf:{llama_config}", "-b", str(size), *flags)
        assert json.loads(out)["verdict"]["status"] == status, size


def test_a_trainer_without_a_sequence_length_is_asked_for_one(tmp_path):
    trainer = trainer_for(tmp_path)
    with pytest.raises(vramplan.UserError, match="seq_len"):
        estimate_trainer(trainer, gpu="t4")


# -- accelerate: find_executable_batch_size starts from the predicted batch -------------------


def mlp() -> torch.nn.Module:
    blocks = [torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()) for _ in range(3)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(512, 10))


def test_the_accelerate_decorator_starts_from_the_predicted_batch():
    pytest.importorskip("accelerate")
    from vramplan.integrations.accelerate import find_executable_batch_size

    model, tried, shape = mlp(), [], (256, 512)  # one sample: 256 rows of 512 features
    one = vramplan.Session(model, gpu="t4").estimate(batch_size=1, input_shape=shape)
    card = dict(gpu_memory=f"{one.verdict.compared_bytes // 2**20 + 24}MiB", headroom=0.0)

    @find_executable_batch_size(model=model, input_shape=shape, **card)
    def train(batch_size, label):
        tried.append(batch_size)
        if len(tried) == 1:  # the real GPU disagrees once: accelerate's fallback takes over
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB")
        return label

    assert train("done") == "done"
    first = tried[0]
    assert first > 1 and first == train.predicted and tried[1] == int(first * 0.9)
    session = vramplan.Session(model, **card)
    at = lambda n: session.estimate(batch_size=n, input_shape=shape).verdict.status  # noqa: E731
    assert at(first) == "fits" and at(first + 1) != "fits"


# -- Lightning: a BatchSizeFinder that traces instead of trying ---------------------------------


def test_the_lightning_finder_sets_the_largest_batch_that_fits():
    L = pytest.importorskip("lightning")
    from vramplan.integrations.lightning import VramplanBatchSizeFinder, lightning_step

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 2
            self.layers = mlp()

        def training_step(self, batch, index):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.layers(x).flatten(0, 1), y.flatten())
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

        def train_dataloader(self):
            x, y = torch.randn(32, 256, 512), torch.randint(0, 10, (32, 256))
            return torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(x, y), batch_size=self.batch_size
            )

    net = Net()
    step = lambda n: vramplan.estimate_step(  # noqa: E731
        lightning_step,
        net,
        (torch.empty(n, 256, 512), torch.empty(n, 256, dtype=torch.long)),
        precision="amp-bf16",
        **card,
    )
    card = dict(gpu="t4")
    card = dict(gpu_memory=f"{step(1).verdict.compared_bytes // 2**20 + 12}MiB", headroom=0.0)
    finder = VramplanBatchSizeFinder(**card)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision="bf16-mixed",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(net)
    batch = finder.optimal_batch_size
    assert batch > 1 and net.batch_size == batch
    assert trainer.train_dataloader.batch_size == batch  # what fit() trained with
    assert step(batch).verdict.status == "fits" and step(batch + 1).verdict.status != "fits"
