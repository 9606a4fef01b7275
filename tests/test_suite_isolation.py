"""The suite's own isolation under pytest-xdist: rendezvous ports per worker, one thread per training process."""

from __future__ import annotations

import os

from script_runs import free_port, port_block, script_env


def test_workers_draw_rendezvous_ports_from_blocks_of_their_own() -> None:
    blocks = [port_block(f"gw{i}") for i in range(16)]
    assert all(not set(a) & set(b) for i, a in enumerate(blocks) for b in blocks[i + 1:])
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    assert max(b[-1] for b in blocks) < ephemeral_low  # the kernel never hands these out for bind(0) or connect
    mine = port_block(os.environ.get("PYTEST_XDIST_WORKER", ""))
    assert free_port() in mine and free_port() != free_port()


def test_training_scripts_run_one_thread_per_process_on_a_port_of_this_worker() -> None:
    # Lightning's launcher gives each rank cpus // processes threads unless OMP_NUM_THREADS is set, while a
    # one-device reference keeps its own: the two summed in different orders on a 16-core machine.
    env = script_env()
    assert env["OMP_NUM_THREADS"] == "1"
    assert int(env["MASTER_PORT"]) in port_block(os.environ.get("PYTEST_XDIST_WORKER", ""))
