"""Bare encoders (``BertModel`` as sentence-transformers ships it, ``Dinov2Model``) train on
their pooled embeddings. Ground truth: PyTorch's profiler on a real CPU run of the same
step, and the loss's definition."""

from __future__ import annotations

import json

import pytest
import torch

from vramplan import Recipe
from vramplan.measurement.run import measure_built
from vramplan.pipeline import trace_and_estimate
from vramplan.sources import resolve
from vramplan.sources.hf import in_batch_contrastive

pytest.importorskip("transformers")

BERT = {
    "architectures": ["BertModel"],
    "model_type": "bert",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 512,
    "max_position_embeddings": 128,
}
DINOV2 = {
    "architectures": ["Dinov2Model"],
    "model_type": "dinov2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 112,  # 8 x 8 patches: the peak is in backward
    "patch_size": 14,
    "num_channels": 3,
}


def _spec(tmp_path, config: dict) -> str:
    path = tmp_path / config["model_type"] / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return f"hf:{path}"


@pytest.mark.parametrize("config,knobs", [(BERT, {"seq_len": 64}), (DINOV2, {})])
def test_bare_encoders_trace_what_a_real_cpu_step_holds(tmp_path, config, knobs):
    spec = _spec(tmp_path, config)
    recipe = Recipe(batch_size=4, optimizer="adamw", **knobs)
    estimate = trace_and_estimate(resolve(spec, recipe), recipe, "cpu")[0]
    real = measure_built(resolve(spec, recipe, "cpu"), recipe, "cpu", steps=2)
    assert abs(estimate.peak.allocated_bytes - real.allocated_bytes) <= 0.01 * real.allocated_bytes
    assert any("bare encoder" in note for note in estimate.notes)


def test_in_batch_loss_is_cross_entropy_over_each_samples_own_column():
    """Pooled embeddings whose own pair scores far above the others give a loss near 0;
    equal embeddings give log(batch)."""
    from types import SimpleNamespace

    apart = SimpleNamespace(pooler_output=10 * torch.eye(4), last_hidden_state=None)
    same = SimpleNamespace(pooler_output=None, last_hidden_state=torch.ones(4, 3, 8))
    assert in_batch_contrastive(apart).item() < 1e-6
    assert in_batch_contrastive(same).item() == pytest.approx(torch.log(torch.tensor(4.0)))
