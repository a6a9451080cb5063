"""The worker: runs tasks one at a time on its local model server."""
