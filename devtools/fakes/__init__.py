"""Stand-ins for outside services (real sockets, fake behaviour) used by tests and benchmarks."""
