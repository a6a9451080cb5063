"""Performance and reliability harnesses with their target figures (not timed tests)."""
