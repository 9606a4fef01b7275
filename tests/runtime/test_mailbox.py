"""Each rank's mailbox: peers leave and read values over a connection; a stopped, ended or unknown peer is told apart."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import torch.distributed as dist
from fault_runs import unused_pid

from lightning_pipedream.runtime.faults.mailbox import ANSWERED, GONE, SILENT, Mailbox, process_state


@pytest.fixture
def pair():
    store = dist.HashStore()
    boxes = [Mailbox(), Mailbox()]
    for rank, box in enumerate(boxes):
        box.open(rank, 2, store, stage=rank)
    assert all(box.learn_peers() for box in boxes)
    yield boxes
    for box in boxes:
        box.close()


def test_peers_put_and_read_values(pair):
    zero, one = pair
    assert zero.peers[1].stage == 1 and zero.is_local(1) and zero.local_state(1) in ("R", "S")
    one.put_here("report", {"doing": "step 3"})
    assert zero.ask(1, "report") == (ANSWERED, {"doing": "step 3"})
    assert zero.ask(1, "nothing") == (ANSWERED, None)
    assert zero.put_everywhere("stop", {"rank": 0, "message": "first"}, first=True) == {1: ANSWERED}
    assert zero.put(1, "stop", {"rank": 0, "message": "second"}, first=True) == ANSWERED
    assert one.here("stop") == {"rank": 0, "message": "first"}  # the first reason stays: it is the cause


def test_a_request_without_the_runs_token_is_ignored(pair):
    zero, one = pair
    with socket.create_connection((one.me.host, one.me.port), timeout=2) as conn:
        conn.settimeout(2)
        conn.sendall(json.dumps({"op": "put", "key": "stop", "value": "anyone"}).encode() + b"\n")
        assert conn.recv(100) == b""  # closed without an answer
    assert one.here("stop") is None


def test_an_ended_peer_and_an_unknown_one(pair):
    zero, one = pair
    one.close()
    assert zero.ask(1, "report")[0] == GONE
    assert zero.ask(5, "report")[0] == SILENT  # never registered: nothing to ask


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_process_states():
    # A stopped process ("T") is seen by the SIGSTOP tests of tests/strategy/test_faults.py.
    assert process_state(os.getpid()) in ("R", "S")
    assert process_state(os.getpid(), started=1) is None  # another process than the one started then
    assert process_state(unused_pid()) is None
