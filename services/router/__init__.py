"""The router: validates route requests, picks a worker, publishes the task."""
