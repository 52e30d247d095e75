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
