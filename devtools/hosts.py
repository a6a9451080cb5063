"""Test hosts: network namespaces joined to this machine by veth pairs.

Each `NetnsHost` is a "host" with an address of its own, reached from this machine over one
link that a test can cut (`cut`: the link goes down, packets are dropped and TCP connections
hang as across a real partition; no reset is sent) and mend. A program started with `command`
runs inside the host: its loopback is the host's own (an Ollama stand-in there is that host's
local backend), and this machine is `gateway_ip`. `kill_all` ends every process inside at once,
as a machine that loses its power.

`netns_hosts(n, routed=True)` also lets the hosts reach each other through this machine (IPv4
forwarding on here, its old value restored at the end; each host routes the test network via
its gateway), so services on three hosts can form one fleet, and cutting one host's link
partitions it from all the others.

Nothing addressed to a test host ever leaves this machine: each host's subnet has a blackhole
route behind its link's own route, so while a link is cut its packets are dropped here instead
of following the default route out. And the hosts route only the test network, not a default
route, so nothing inside them can send elsewhere through this machine.

Needs root and ``ip`` (iproute2); `netns_unavailable` says why not, for a skip. Runs on one
machine at a time share the addresses (10.231.<index>.0/30), so `netns_hosts` holds a lock for
as long as its hosts exist. A run killed before its clean-up leaves its hosts behind, and a
stale link holding the same address would take the new host's traffic (its route is found
first): so whoever takes the lock first removes every test host it finds, all of them stale,
since the lock's holder is the only run that makes them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Final

# Names of a test host's namespace and of its link's ends, this machine's end first.
NAMESPACE_PREFIX: Final = "cohost"
LINK_PREFIX: Final = "coh"
# Addresses of the test hosts: 10.231.<index>.0/30, this machine's end .1, the host's .2.
SUBNET_PREFIX: Final = "10.231"
TEST_NETWORK: Final = f"{SUBNET_PREFIX}.0.0/16"
# Behind the link's own route (metric 0): used only while the link is down.
_BLACKHOLE_METRIC: Final = "4000"
_FORWARDING: Final = Path("/proc/sys/net/ipv4/ip_forward")
_LOCK: Final = Path(tempfile.gettempdir()) / "coordinator-test-hosts.lock"


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


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


class NetnsHost:
    """One namespace, one veth pair to this machine."""

    def __init__(self, index: int) -> None:
        tag = f"{os.getpid() % 100000}{index}"
        self.index = index
        self.name = f"{NAMESPACE_PREFIX}{tag}"
        self.outer = f"{LINK_PREFIX}{tag}"  # this machine's end of the link
        self.inner = f"con{tag}"  # the host's end
        self.gateway_ip = f"{SUBNET_PREFIX}.{index}.1"
        self.ip = f"{SUBNET_PREFIX}.{index}.2"
        self.subnet = f"{SUBNET_PREFIX}.{index}.0/30"

    def create(self) -> NetnsHost:
        """Make the namespace and its link, with the blackhole route behind the link's."""
        _ip("netns", "add", self.name)
        _ip("link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        _ip("link", "set", self.inner, "netns", self.name)
        _ip("addr", "add", f"{self.gateway_ip}/30", "dev", self.outer)
        _ip("link", "set", self.outer, "up")
        _ip("route", "replace", "blackhole", self.subnet, "metric", _BLACKHOLE_METRIC)
        inside = ("netns", "exec", self.name, "ip")
        _ip(*inside, "addr", "add", f"{self.ip}/30", "dev", self.inner)
        _ip(*inside, "link", "set", self.inner, "up")
        _ip(*inside, "link", "set", "lo", "up")
        return self

    def route_test_network(self) -> None:
        """Reach the other test hosts through this machine (which must forward)."""
        _ip("netns", "exec", self.name, "ip", "route", "add", TEST_NETWORK, "via", self.gateway_ip)

    def command(self, *args: str) -> list[str]:
        """``args`` run inside this host (``ip netns exec`` becomes the program: its pid is
        the program's)."""
        return ["ip", "netns", "exec", self.name, *args]

    def cut(self) -> None:
        """Cut the link: nothing passes either way until `mend`."""
        _ip("link", "set", self.outer, "down")

    def mend(self) -> None:
        """Restore the link; connections that survived the cut carry on."""
        _ip("link", "set", self.outer, "up")

    def pids(self) -> list[int]:
        """Every process running inside this host."""
        try:
            listed = _ip("netns", "pids", self.name)
        except subprocess.CalledProcessError:
            return []
        return [int(pid) for pid in listed.split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process inside, at once (whoever started one still reaps it)."""
        killed = self.pids()
        for pid in killed:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return killed

    def destroy(self) -> None:
        """Kill what still runs inside, then remove the link, the route and the namespace."""
        self.kill_all()
        with suppress(subprocess.CalledProcessError):
            _ip("link", "delete", self.outer)  # takes its peer with it
        with suppress(subprocess.CalledProcessError):
            _ip("route", "delete", "blackhole", self.subnet, "metric", _BLACKHOLE_METRIC)
        with suppress(subprocess.CalledProcessError):
            _ip("netns", "delete", self.name)


def stale_hosts() -> list[str]:
    """Test hosts' namespaces and links on this machine (every one of them stale while no run
    holds the lock)."""
    namespaces = [
        line.split()[0]
        for line in _ip("netns", "list").splitlines()
        if line.startswith(NAMESPACE_PREFIX)
    ]
    # `ip -o link show`: "7: coh14682@if6: <...> ...", one line per link.
    names = (
        line.split()[1].split("@")[0].rstrip(":") for line in _ip("-o", "link", "show").splitlines()
    )
    links = [name for name in names if name.startswith(LINK_PREFIX)]
    return namespaces + links


def remove_stale_hosts() -> list[str]:
    """Remove what an earlier run left: its processes, namespaces, links and blackhole routes.
    Call it only while holding the lock. Says what it removed."""
    removed = stale_hosts()
    for name in removed:
        if not name.startswith(NAMESPACE_PREFIX):
            with suppress(subprocess.CalledProcessError):
                _ip("link", "delete", name)  # takes its peer, its address and its route
            continue
        with suppress(subprocess.CalledProcessError):
            for pid in _ip("netns", "pids", name).split():
                with suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        with suppress(subprocess.CalledProcessError):
            _ip("netns", "delete", name)
    for line in _ip("route", "show", "type", "blackhole").splitlines():
        subnet = line.split()[1] if line.startswith("blackhole ") else ""
        if subnet.startswith(f"{SUBNET_PREFIX}."):
            with suppress(subprocess.CalledProcessError):
                _ip("route", "delete", "blackhole", subnet, "metric", _BLACKHOLE_METRIC)
                removed.append(f"blackhole {subnet}")
    return removed


@contextmanager
def _forwarding() -> Iterator[None]:
    """IPv4 forwarding on in this machine's namespace, its old value back at the end."""
    before = _FORWARDING.read_text().strip()
    _FORWARDING.write_text("1\n")
    try:
        yield
    finally:
        _FORWARDING.write_text(f"{before}\n")


@contextmanager
def netns_hosts(count: int, *, routed: bool = False) -> Iterator[list[NetnsHost]]:
    """``count`` fresh hosts, removed at the end with every process still inside them.

    ``routed``: the hosts reach each other through this machine, as machines on one network.
    """
    with _LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        remove_stale_hosts()
        with _forwarding() if routed else nullcontext():
            hosts: list[NetnsHost] = []
            try:
                for index in range(1, count + 1):
                    hosts.append(NetnsHost(index).create())
                    if routed:
                        hosts[-1].route_test_network()
                yield hosts
            finally:
                for host in hosts:
                    host.destroy()
