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


def test_meters_left_in_the_order_they_were_entered_put_torch_s_resize_back():
    # WindowMemory's meter and a test's complete meter are entered and left per step, not nested: the first one
    # entered leaves first. CI once saw a meter's wrapper left on UntypedStorage.resize_ after that.
    plain = torch.UntypedStorage.resize_
    first, second = LiveTensorBytes(), LiveTensorBytes()
    first.__enter__()
    second.__enter__()
    flat = torch.ones(100)  # 400 bytes, seen by both
    flat.untyped_storage().resize_(0)
    assert first.live == second.live == 0 and first.peak == second.peak == 400  # both follow the resize
    first.__exit__(None, None, None)
    assert torch.UntypedStorage.resize_ is not plain  # the second one still follows resizes
    second.__exit__(None, None, None)
    assert torch.UntypedStorage.resize_ is plain
