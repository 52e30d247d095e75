"""The rough edges a new user hits: sizes past GiB, repeated blocks folded in the
top-modules table, what llm assumes, what a plan lever saves, and where a report went."""

from __future__ import annotations

import json

from vramplan.report.terminal import group_repeated
from vramplan.result import ModuleUsage
from vramplan.units import format_bytes, parse_count


def test_sizes_go_past_gibibytes():
    assert format_bytes(3 * 2**40) == "3.0 TiB"
    assert format_bytes(5 * 2**50) == "5.0 PiB"
    assert format_bytes(2 * 10**12, units="decimal") == "2.0 TB"
    assert format_bytes(1205444335 * 2**30).endswith("PiB")


def test_a_trillion_parameters_read_exactly():
    assert parse_count("1.3T", "parameter count") == 1_300_000_000_000
    assert parse_count("405B", "parameter count") == 405_000_000_000


def test_repeated_blocks_share_a_row_largest_first():
    usages = [ModuleUsage(f"transformer.h.{i}", "GPT2Block", 336) for i in range(12)]
    usages += [ModuleUsage(f"transformer.h.{i}.attn", "GPT2Attention", 100) for i in range(2)]
    usages += [ModuleUsage("lm_head", "Linear", 5000)]
    rows = group_repeated(usages)
    assert rows[0] == ("lm_head", "Linear", 1, 5000, 5000)
    assert rows[1] == ("transformer.h.*", "GPT2Block", 12, 12 * 336, 336)
    assert rows[2] == ("transformer.h.*.attn", "GPT2Attention", 2, 200, 100)


def test_the_table_shows_each_block_once(run_cli, tiny_gpt2_config):
    code, out, _ = run_cli(
        "estimate", f"hf:{tiny_gpt2_config}", "--optimizer", "sgd", "--batch-size", "8"
    )
    assert code == 0
    table = out.split("Top modules", 1)[1]
    assert "transformer.h.*.attn ×2" in table
    assert "transformer.h.0." not in table and "transformer.h.1." not in table


def test_llm_says_which_precision_it_assumed(run_cli, tiny_gpt2_config):
    code, out, _ = run_cli("llm", f"hf:{tiny_gpt2_config}", "--seq-len", "32", "--json")
    data = json.loads(out)
    assert code == 0 and data["recipe"]["precision"] == "amp-bf16"
    assert any("llm's default" in note for note in data["notes"])
    code, out, _ = run_cli(
        "llm", f"hf:{tiny_gpt2_config}", "--seq-len", "32", "--precision", "fp32", "--json"
    )
    data = json.loads(out)
    assert data["recipe"]["precision"] == "fp32"
    assert not any("llm's default" in note for note in data["notes"])


def test_plan_levers_report_tensor_savings_too(run_cli, tiny_gpt2_config):
    code, out, _ = run_cli(
        "plan", f"hf:{tiny_gpt2_config}", "--gpu", "t4", "--batch-size", "4", "--json"
    )
    assert code == 0
    data = json.loads(out)
    baseline = data["estimate"]["peak"]["allocated_bytes"]
    levers = {lever["name"]: lever for lever in data["levers"]}
    # 8-bit states: under a quarter of AdamW's, whatever the cached segments do
    assert levers["8-bit Adam"]["saved_allocated_bytes"] > 0
    for lever in levers.values():
        assert lever["saved_allocated_bytes"] == baseline - lever["peak"]["allocated_bytes"]


def test_reports_say_where_they_went(run_cli, tiny_gpt2_config, tmp_path):
    report = tmp_path / "report.html"
    code, out, err = run_cli("estimate", f"hf:{tiny_gpt2_config}", "--html", str(report), "--json")
    assert code == 0 and report.is_file()
    assert f"wrote {report}" in err
    json.loads(out)  # stdout stays the JSON object alone
