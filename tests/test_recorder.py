"""The recorder: storages resized in place (FSDP frees and re-gathers its unsharded
parameters that way) and wrapper subclasses (DTensor shards)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vramplan.trace.recorder import AllocationRecorder, storage_resizes


def test_a_storage_resized_to_zero_dies_and_is_born_again():
    with FakeTensorMode(), AllocationRecorder() as recorder, storage_resizes(recorder):
        tensor = torch.empty(1024)  # 4 KiB
        storage = tensor.untyped_storage()
        storage.resize_(0)
        storage.resize_(8192)
        storage.resize_(8192)  # no change: no event
    first, second = recorder.records
    assert (first.nbytes, second.nbytes) == (4096, 8192)
    assert first.free_index is not None and first.free_index < second.alloc_index
    assert second.free_index is None and "resized" in second.tags
    assert recorder.event_count == 3


def test_a_tensor_grown_in_place_is_counted_at_its_new_size():
    with FakeTensorMode(), AllocationRecorder() as recorder, storage_resizes(recorder):
        out = torch.empty(0)
        torch.mm(torch.ones(64, 64), torch.ones(64, 64), out=out)  # resizes ``out``
    assert [r.nbytes for r in recorder.records if r.free_index is None][-1] == 64 * 64 * 4


def test_a_device_query_answers_as_fake_tensor_mode_does_and_is_no_op():
    with FakeTensorMode():
        tensor = torch.empty(4, device="cuda")
        unrecorded = torch.ops.prim.device.default(tensor)
        with AllocationRecorder() as recorder:
            recorded = torch.ops.prim.device.default(tensor)
            torch.mm(torch.ones(2, 2, device="cuda"), torch.ones(2, 2, device="cuda"))
    assert recorded == unrecorded == torch.device("cuda", 0)
    assert all(name != "device" for _, name in recorder.op_counts)
    assert sorted(name for _, name in recorder.op_counts) == ["mm", "ones"]
