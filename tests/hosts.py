"""Test hosts: network namespaces joined to this machine by veth pairs.

Each `NetnsHost` is a "host" with an address of its own, reached from this machine over one
link that a test can cut (`cut`: the link goes down, packets are dropped and TCP connections
hang as across a real partition; no reset is sent) and mend. A program started with `command`
runs inside the host: its loopback is the host's own (an Ollama stand-in there is that host's
local backend), and this machine is `gateway_ip`.

Needs root and ``ip`` (iproute2); `netns_unavailable` says why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress

# Addresses of the test hosts: 10.231.<index>.0/30, this machine's end .1, the host's .2.
SUBNET_PREFIX = "10.231"


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"coprobe{os.getpid() % 100000}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], check=False, capture_output=True, text=True
    )
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], check=False, capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NetnsHost:
    """One namespace, one veth pair to this machine."""

    def __init__(self, index: int) -> None:
        tag = f"{os.getpid() % 100000}{index}"
        self.name = f"cohost{tag}"
        self.outer = f"coh{tag}"  # this machine's end of the link
        self.inner = f"con{tag}"  # the host's end
        self.gateway_ip = f"{SUBNET_PREFIX}.{index}.1"
        self.ip = f"{SUBNET_PREFIX}.{index}.2"

    def create(self) -> NetnsHost:
        _ip("netns", "add", self.name)
        _ip("link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        _ip("link", "set", self.inner, "netns", self.name)
        _ip("addr", "add", f"{self.gateway_ip}/30", "dev", self.outer)
        _ip("link", "set", self.outer, "up")
        inside = ("netns", "exec", self.name, "ip")
        _ip(*inside, "addr", "add", f"{self.ip}/30", "dev", self.inner)
        _ip(*inside, "link", "set", self.inner, "up")
        _ip(*inside, "link", "set", "lo", "up")
        return self

    def command(self, *args: str) -> list[str]:
        """``args`` run inside this host."""
        return ["ip", "netns", "exec", self.name, *args]

    def cut(self) -> None:
        """Cut the link: nothing passes either way until `mend`."""
        _ip("link", "set", self.outer, "down")

    def mend(self) -> None:
        """Restore the link; connections that survived the cut carry on."""
        _ip("link", "set", self.outer, "up")

    def destroy(self) -> None:
        with suppress(subprocess.CalledProcessError):
            _ip("link", "delete", self.outer)  # takes its peer with it
        with suppress(subprocess.CalledProcessError):
            _ip("netns", "delete", self.name)


@contextmanager
def netns_hosts(count: int) -> Iterator[list[NetnsHost]]:
    """``count`` fresh hosts, removed at the end (the processes inside them must be gone)."""
    hosts: list[NetnsHost] = []
    try:
        for index in range(1, count + 1):
            hosts.append(NetnsHost(index).create())
        yield hosts
    finally:
        for host in hosts:
            host.destroy()
