"""Real runs beside estimates, the leak check, and calibrated device profiles."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vramplan.device.profile import DeviceProfile, load_profile, save_profile
from vramplan.measurement.leak import check_leak


@pytest.fixture
def models(tmp_path):
    path = tmp_path / "nets.py"
    path.write_text(
        "from torch import nn\n"
        "class Leaky(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(64, 256)\n"
        "        self.kept = []\n"
        "    def forward(self, x):\n"
        "        out = self.fc(x).relu()\n"
        "        self.kept.append(out)  # keeps every step's output and its graph\n"
        "        return out\n"
        "def leaky():\n"
        "    return Leaky()\n"
        "def clean():\n"
        "    return nn.Sequential(nn.Linear(64, 256), nn.ReLU())\n"
    )
    return path


def test_measure_prints_estimate_beside_measurement(run_cli, models):
    code, out, _ = run_cli(
        "measure",
        f"{models}:clean",
        "--batch-size",
        "16",
        "--device",
        "cpu",
        "--steps",
        "3",
        "--json",
    )
    data = json.loads(out)
    assert code == 0 and data["measured"]["device"] == "cpu"
    assert data["estimate"]["schema"] == "vramplan.estimate/1"
    assert abs(data["errors"]["allocated"]) <= 0.01
    assert len(data["measured"]["after_step_bytes"]) == 3
    assert data["leak"]["leaking"] is False


def test_leak_check_flags_a_model_that_keeps_its_graphs(run_cli, models):
    code, out, _ = run_cli(
        "measure",
        f"{models}:leaky",
        "--batch-size",
        "64",
        "--device",
        "cpu",
        "--steps",
        "4",
        "--json",
    )
    leak = json.loads(out)["leak"]
    assert code == 0 and leak["leaking"] is True
    assert leak["bytes_per_step"] >= 64 * 256 * 4  # at least one kept output per step


def test_terminal_output(run_cli, models):
    code, out, _ = run_cli("measure", f"{models}:clean", "--device", "cpu")
    assert code == 0 and "Estimate vs measurement" in out and "no leak" in out


def test_check_leak_rules():
    assert not check_leak((1_000_000, 2_000_000, 2_000_000)).leaking  # step 1 adds state
    assert check_leak((1_000_000, 2_000_000, 3_000_000, 4_000_000)).leaking
    assert not check_leak((1_000_000, 2_000_000)).leaking  # too few steps to judge


def test_measure_bad_device(run_cli, models):
    code, _, err = run_cli("measure", f"{models}:clean", "--device", "tpu")
    assert code == 2 and "unknown device" in err
    import torch

    if not torch.cuda.is_available():
        code, _, err = run_cli("measure", f"{models}:clean", "--device", "cuda")
        assert code == 2 and "no CUDA device" in err
        code, _, err = run_cli("calibrate")
        assert code == 2 and "needs a CUDA GPU" in err


def test_calibrated_profile_replaces_the_runtime_table(run_cli, gpt2_config, tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMPLAN_PROFILE_DIR", str(tmp_path))
    config = gpt2_config(vocab_size=256, n_positions=32, n_layer=1)
    code, out, _ = run_cli("estimate", f"hf:{config}", "--seq-len", "16", "--gpu", "l4", "--json")
    before = json.loads(out)
    profile = DeviceProfile(
        gpu="L4",
        total_bytes=23034 * 2**20,
        driver="test",
        cuda="12.4",
        torch="2.5",
        cuda_context_bytes=1_343 * 2**20,
        cublas_workspace_bytes=8519680,
    )
    path = save_profile(profile)
    assert load_profile(path) == profile
    code, out, _ = run_cli("estimate", f"hf:{config}", "--seq-len", "16", "--gpu", "l4", "--json")
    after = json.loads(out)
    assert after["runtime"]["cuda_context"] == 1_343 * 2**20
    assert after["peak"]["device_total_bytes"] == (
        after["peak"]["reserved_bytes"] + 1_343 * 2**20 + after["runtime"]["driver_reserved"]
    )
    assert after["peak"]["reserved_bytes"] == before["peak"]["reserved_bytes"]
    code, _, err = run_cli("estimate", f"hf:{config}", "--profile", str(tmp_path / "x"))
    assert code == 2 and "device profile not found" in err


def test_device_totals_are_compared_in_the_estimates_counter(models):
    """NVML's per-process reading has no driver reserve; an nvml-v1 estimate counts it. The
    H200 harvest (benchmarks/results/gpu-nvidia-h200-2026-11-27) read 938 MiB for the process
    of resnet18-sgd and a 615.1 MiB reserve (NVML v2 reserved)."""
    import vramplan
    from vramplan.measurement.compare import errors_of, relative_error
    from vramplan.measurement.nvml import NvmlUsed
    from vramplan.measurement.run import Measurement

    harvest = "benchmarks/results/gpu-nvidia-h200-2026-11-27/harvest.json"
    with open(harvest) as handle:
        reserve = json.load(handle)["nvml_idle"]["v2_reserved"]
    process = 938 * 2**20
    used = NvmlUsed(process, "nvml-v2", reserve)
    measured = Measurement("cuda:NVIDIA H200", 3, 10, (10,), 20, process, used=used)
    for counter, expected in (("nvml-v1", process + reserve), ("nvml-v2", process)):
        session = vramplan.Session(f"{models}:clean", gpu="h200", used_counter=counter)
        estimate = session.estimate(batch_size=4, input_shape=(64,))
        assert estimate.details["used_counter"] == counter
        errors = errors_of(estimate, measured)
        assert errors["device_total"] == relative_error(estimate.peak.device_total_bytes, expected)
    unknown = NvmlUsed(process, "nvml-v2")  # a driver that does not report its reserve
    assert unknown.in_counter("nvml-v1") is None and unknown.in_counter("nvml-v2") == process
    assert NvmlUsed(process + reserve, "nvml-v1", reserve).in_counter("nvml-v2") == process


class _Stop(Exception):
    pass


@pytest.mark.parametrize("on_card", [False, True])
def test_cuda_measurement_starts_after_the_cast_copies_are_released(monkeypatch, on_card):
    """Building on the card and casting (bf16 -> fp32 -> bf16 for a Hub config) leaves the
    earlier copies cached: the harness empties the cache before it resets the peaks, so
    ``max_memory_reserved`` starts from the weights (the TinyLlama row held 3292 MiB of
    them; test_allocator's cast sequence shows the arithmetic). Weights built on the card
    go to the host and back in between, on an emptied cache, so that they sit in segments
    as a load in the run's dtype puts them; a model still on the meta device is left to
    the run."""
    import torch

    from vramplan.measurement import run

    calls = []
    for name in ("init", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *_, name=name: calls.append(name))
    clear = "_cuda_clearCublasWorkspaces"
    monkeypatch.setattr(torch._C, clear, lambda: calls.append(clear), raising=False)
    monkeypatch.setattr(run, "_parked_on_host", lambda model: on_card)

    class Model(torch.nn.Linear):
        def to(self, device):
            calls.append(f"to {device}")
            return self

    def stop(*_args):
        raise _Stop

    monkeypatch.setattr(run, "_run", stop)
    with pytest.raises(_Stop):
        run._measure_cuda(SimpleNamespace(model=Model(2, 2)), None, 1, None)
    moved = ["to cpu", "empty_cache", "to cuda"] if on_card else []
    assert calls == ["init", clear, *moved, "empty_cache", "reset_peak_memory_stats"]
