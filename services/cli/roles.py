"""The roles a deployment runs: the `coordinator` command of each, how ``coordinator health``
tells it is up, and which run once per worker id. Pure.

The units (`units`), the NATS users (`permissions`) and the health checks (`health`) are all
built from these names, so they cannot drift apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from schemas.subjects import REAPER_SERVICE

DEPLOY_DIR: Final = Path(__file__).resolve().parents[2] / "deploy"

# Each service role: the `coordinator` command that runs it, and how `coordinator health`
# tells it is up: its NATS micro service answers PING (``$SRV.PING.<name>``); its registry
# entry is fresh (workers); its HTTP endpoint answers (the gateway); or, for the reaper, which
# shows itself nowhere on the bus, that NATS and the TASKS stream answer its user.
SERVICE_ROLES: Final[dict[str, tuple[str, ...]]] = {
    "router": ("router",),
    "stats": ("stats", "serve"),
    "reaper": ("reaper",),
    "gateway": ("gateway",),
    "web-search": ("web-search",),
    "worker": ("worker",),
}
MICRO_SERVICES: Final = {
    "router": "coordinator-router",
    "stats": "coordinator-stats",
    "reaper": REAPER_SERVICE,
}
# Roles with one process per WORKER_ID: a systemd template unit whose instance is the id.
PER_WORKER: Final = frozenset({"worker", "web-search"})
