"""Test hosts (network namespaces) for the tests: they live in `devtools.hosts`, which the
benchmarks use too (benchmarks import nothing from tests)."""

from devtools.hosts import NetnsHost, netns_hosts, netns_unavailable

__all__ = ["NetnsHost", "netns_hosts", "netns_unavailable"]
