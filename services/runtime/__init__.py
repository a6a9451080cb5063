"""What every service shares: settings, bus, lifecycle, logging, tracing, errors."""
