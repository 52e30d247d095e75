"""The accuracy study's summary (``benchmarks/accuracy/run.py``) counts how many measured
device figures fell inside the estimate's [low, high] range."""

from benchmarks.accuracy.run import COLUMNS, RANGED, summarise


def _row(error: float, inside: str | None) -> dict:
    row = {"error_reserved": error, "error_allocated": error}
    if inside:
        row["inside_reserved"] = inside
    return row


def test_summary_counts_the_rows_inside_their_range():
    rows = [_row(-0.10, "no"), _row(0.01, "yes"), _row(0.02, "yes"), _row(0.0, None)]
    lines = {line.split("|")[1].strip(): line for line in summarise(rows)[2:]}
    assert lines["reserved"].rstrip(" |").endswith("2 of 3")
    assert "-10.00%" in lines["reserved"]
    assert lines["allocated"].rstrip(" |").endswith("-")


def test_every_ranged_figure_has_its_columns():
    for figure in RANGED:
        assert {f"low_{figure}", f"high_{figure}", f"inside_{figure}"} <= set(COLUMNS)


def test_fresh_processes_run_at_once_and_the_csv_keeps_the_workloads_order(tmp_path, monkeypatch):
    """Two workloads in two fresh processes at once: the second finishes first, the CSV
    still lists them as the study does."""
    import csv
    import sys
    import threading
    import time

    from benchmarks.accuracy import run

    started = []
    both = threading.Barrier(2, timeout=10)

    def fake_fresh(row, device):
        started.append(row["name"])
        both.wait()  # fails unless both run at once
        time.sleep(0.3 if row["name"] == "first" else 0.0)
        return {"name": row["name"], "status": "ok", "error_allocated": 0.0}

    monkeypatch.setattr(run, "run_fresh", fake_fresh)
    monkeypatch.setattr(run, "load_workloads", lambda: [{"name": "first"}, {"name": "second"}])
    argv = ["run", "--device", "cuda", "--jobs", "2", "--output", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    finished = [index for index, _ in run.run_all(run.load_workloads(), "cuda", True, 2)]
    assert finished == [1, 0]
    both.reset()
    run.main()
    (path,) = tmp_path.glob("*.csv")
    with path.open() as handle:
        assert [r["name"] for r in csv.DictReader(handle)] == ["first", "second"]
