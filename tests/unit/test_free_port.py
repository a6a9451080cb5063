"""Ports for test servers: below the kernel's ephemeral range, one block per pytest-xdist
worker, so that no client's connection and no other worker can take one meanwhile."""

from __future__ import annotations

import socket

import pytest

from devtools.servers import _port_block, free_port

EPHEMERAL_FROM = 32768


def test_each_worker_walks_its_own_block_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    blocks = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        ports = [free_port() for _ in range(5)]
        assert len(set(ports)) == 5
        assert all(20000 <= port < EPHEMERAL_FROM for port in ports)
        blocks.append(ports)
    first, second = blocks
    assert max(first) < min(second)


def test_a_port_something_listens_on_is_passed_over() -> None:
    port = free_port()
    while port + 2 >= _port_block().stop:  # the walk's end: it goes on from the block's start
        port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        assert free_port() > port + 1  # the next free one after it
