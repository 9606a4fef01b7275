"""The spec table: one entry per schedule, and the properties the other layers read from it."""

from __future__ import annotations

import pytest

from lightning_pipedream.schedule.builders import ASYNCHRONOUS, REPLICATED_SCHEDULES, SCHEDULES, build_schedule
from lightning_pipedream.schedule.specs import SPECS, spec_of


def test_the_table_names_every_schedule_once() -> None:
    assert SCHEDULES == ("gpipe", "1f1b", "pipedream", "2bw", "interleaved", "zb-h1", "zb-v", "dualpipev")
    assert all(SPECS[name].name == name for name in SCHEDULES)
    assert ASYNCHRONOUS == ("pipedream", "2bw")
    assert REPLICATED_SCHEDULES == ("gpipe", "1f1b", "pipedream")


def test_properties_agree_with_what_the_builders_build() -> None:
    for name, spec in SPECS.items():
        assert spec.flushes != spec.asynchronous
        assert spec.exact == spec.flushes  # the flushed schedules equal one device
        chunks = (4 if spec.v_shape else 2) if spec.microbatches else 1
        kwargs = {"minibatches": 3} if spec.asynchronous else {}
        if spec.virtual_stages:
            kwargs["virtual_stages"] = 2
        schedule = build_schedule(name, 2, chunks, **kwargs)
        assert schedule.name == name
        assert (schedule.virtual_stages > 1) == spec.virtual_stages
        if spec.unequal_replicas:
            build_schedule(name, 2, chunks, replicas=[2, 1], **kwargs)


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown schedule 'pipe'. Choose one of: gpipe, 1f1b, pipedream, 2bw, "
                                         r"interleaved, zb-h1, zb-v, dualpipev."):
        spec_of("pipe")
