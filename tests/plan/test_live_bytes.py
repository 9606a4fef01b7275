"""The live-bytes meter (the memory model's yardstick) follows storages freed and re-allocated in place."""

from __future__ import annotations

import torch

from lightning_pipedream.plan.live_bytes import LiveTensorBytes


def test_a_storage_freed_in_place_stops_counting_while_a_reference_lives():
    meter = LiveTensorBytes()
    with meter:
        flat = torch.ones(1000)  # 4000 bytes
        held = flat.view(10, 100)  # what a backend's work object may keep after wait()
        assert meter.live == 4000
        flat.untyped_storage().resize_(0)  # freed now, whatever still refers to it
        assert meter.live == 0
        held.untyped_storage().resize_(800)  # allocated again in place, as FSDP2 re-gathers a unit
        assert meter.live == 800
    assert meter.peak == 4000
    assert torch.UntypedStorage.resize_ is not None and "followed" not in torch.UntypedStorage.resize_.__name__


def test_a_storage_the_meter_never_saw_is_left_out():
    before = torch.zeros(250)
    meter = LiveTensorBytes()
    with meter:
        before.untyped_storage().resize_(0)
        assert meter.live == 0 and meter.peak == 0
