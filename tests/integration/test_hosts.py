"""The test hosts themselves: a run killed before its clean-up must not break the next one.

A run killed mid-test (a CI job cancelled, a terminal closed) leaves its namespaces and links
behind; a stale link holding a host's address takes that address's traffic, and every later
run's host is unreachable ("nothing listens on 10.231.1.2"). The next run removes them first.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from devtools.hosts import netns_hosts, netns_unavailable, stale_hosts
from devtools.servers import free_port, wait_for_port

pytestmark = pytest.mark.skipif(
    (why := netns_unavailable()) is not None, reason=f"no test hosts: {why}"
)

# A run that dies holding two routed hosts: no `finally`, no clean-up, forwarding left on.
KILLED_RUN = """
import os, signal
from devtools.hosts import netns_hosts
with netns_hosts(2, routed=True):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_hosts_left_by_a_killed_run_are_removed_and_the_new_host_is_reachable() -> None:
    killed = subprocess.run([sys.executable, "-c", KILLED_RUN], check=False)
    assert killed.returncode == -9
    left = stale_hosts()
    assert len(left) == 4, left  # two namespaces, two links on this machine's side
    with netns_hosts(1) as [host]:
        assert not set(left) & set(stale_hosts()) - {host.name, host.outer}
        port = free_port()
        server = subprocess.Popen(
            host.command(sys.executable, "-m", "http.server", "-b", host.ip, str(port)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port(port, 10.0, host.ip)  # reached through this run's link, not a stale one
        finally:
            server.kill()
            server.wait()
    assert stale_hosts() == []
