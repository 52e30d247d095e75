"""Short traces shared between workers through a folder (``planner/shared_traces.py``)."""

from vramplan.planner.shared_traces import ShortTraceStore

KEY = ("hf:llama", "model.layers", 4, (), '{"checkpointing": "2"}')


def test_one_worker_claims_a_short_trace_and_the_other_reads_it(tmp_path):
    first, second = ShortTraceStore(tmp_path, {}), ShortTraceStore(tmp_path, {})
    assert first.claim(KEY) and not second.claim(KEY)
    assert KEY not in second  # claimed, not yet published
    first[KEY] = {"events": [1, 2, 3]}
    assert second.wait(KEY, timeout=1) and second[KEY] == {"events": [1, 2, 3]}


def test_a_given_up_claim_leaves_the_trace_to_the_waiter(tmp_path):
    first, second = ShortTraceStore(tmp_path, {}), ShortTraceStore(tmp_path, {})
    assert first.claim(KEY)
    first.release(KEY)  # its trace failed
    assert not second.wait(KEY, timeout=5) and KEY not in second


def test_a_store_starts_from_the_traces_a_worker_already_holds(tmp_path):
    store = ShortTraceStore(tmp_path, {KEY: "kept"})
    assert store[KEY] == "kept"
    assert not store.wait(("other",), timeout=0)
