"""Every start of a run (a torchrun restart) joins under a name of its own, whatever an earlier start left in the
store: the gloo addresses of ranks that are gone, their failure reports, the names and answers of its own join."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_pipedream.runtime.faults.launch import ATTEMPT_KEYS, join_attempt


def join_all(store: dist.Store, world: int, delays: dict[int, float] | None = None) -> list[str]:
    """Every rank's join_attempt, each in a thread, against one store; rank r starts after ``delays[r]`` s."""
    names: dict[int, str] = {}

    def rank(r: int) -> None:
        threading.Event().wait((delays or {}).get(r, 0.0))
        names[r] = join_attempt(store, r, world, timedelta(seconds=60))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    return [names[r] for r in range(world)]


def test_every_start_agrees_on_a_name_no_earlier_start_had():
    store = dist.HashStore()
    first = join_all(store, 3)
    assert len(set(first)) == 1
    # The next start finds all of the first one's keys; rank 2 comes late, as a restarted rank may.
    second = join_all(store, 3, delays={2: 0.5})
    assert len(set(second)) == 1 and second[0] != first[0]


def test_keys_of_a_start_that_a_kill_cut_short_do_not_mislead_the_next():
    store = dist.HashStore()
    # A start in which rank 1 wrote its number and rank 0 answered it, then both were killed before the echo; and a
    # rank 2 whose echo of a still older name is there.
    store.set(f"{ATTEMPT_KEYS}member/1", "oldnumber")
    store.set(f"{ATTEMPT_KEYS}answer/1", "0-oldname oldnumber")
    store.set(f"{ATTEMPT_KEYS}answer/2", "0-oldername oldnumber2")
    store.set(f"{ATTEMPT_KEYS}echo/2", "0-oldername")
    names = join_all(store, 3, delays={0: 0.3})  # rank 0 last: ranks 1 and 2 first find only the old answers
    assert len(set(names)) == 1 and names[0] not in ("0-oldname", "0-oldername")


def test_a_rank_that_never_comes_is_named():
    store = dist.HashStore()
    with pytest.raises(TimeoutError, match=r"The rendezvous did not complete: rank 0 waited for ranks \[1\] to join "
                                           r"until the rendezvous timeout. Start every rank of the run \(the same "
                                           r"WORLD_SIZE, MASTER_ADDR and MASTER_PORT\), or raise the rendezvous "
                                           r"timeout if a rank starts this late."):
        join_attempt(store, 0, 2, timedelta(seconds=0.3))
