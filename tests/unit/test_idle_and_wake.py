from __future__ import annotations

import pytest

from schemas.workers import WorkerRecord
from services.fleet.idle import should_sleep
from services.fleet.policy import choose_sleeper
from services.router.wol import magic_packet

BASE = {"idle_shutdown_s": 600.0, "min_uptime_s": 1800.0}


def test_an_idle_worker_sleeps_only_after_the_idle_time_and_the_minimum_uptime() -> None:
    assert should_sleep(now=2000.0, started_at=0.0, last_activity=1400.0, busy=False, **BASE)
    assert not should_sleep(now=2000.0, started_at=0.0, last_activity=1500.0, busy=False, **BASE)
    assert not should_sleep(now=1700.0, started_at=0.0, last_activity=0.0, busy=False, **BASE)


def test_a_busy_worker_never_sleeps() -> None:
    assert not should_sleep(now=9999.0, started_at=0.0, last_activity=0.0, busy=True, **BASE)


def test_the_magic_packet_is_six_ff_then_sixteen_macs() -> None:
    packet = magic_packet("aa:bb:cc:dd:ee:ff")
    assert len(packet) == 102
    assert packet[:6] == b"\xff" * 6
    assert packet[6:] == bytes.fromhex("aabbccddeeff") * 16
    assert magic_packet("AA-BB-CC-DD-EE-FF") == packet
    with pytest.raises(ValueError, match="not a MAC"):
        magic_packet("aa:bb")


def sleeper(worker_id: str, *models: str, mac: str | None = "aa:bb:cc:dd:ee:ff") -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        host=worker_id,
        instance_id="i",
        pid=1,
        version="t",
        supports=["gpu_inference"],
        models=list(models),
        started_at=0.0,
        heartbeat_at=0.0,
        state="asleep",
        wol_mac=mac,
    )


def test_only_a_sleeper_with_the_model_and_a_wake_address_is_chosen() -> None:
    sleepers = [sleeper("pc-b", "qwen3:8b"), sleeper("pc-a", "qwen3:8b"), sleeper("x", "other")]
    chosen = choose_sleeper("qwen3:8b", sleepers)
    assert chosen is not None and chosen.worker_id == "pc-a"
    assert choose_sleeper("qwen3:8b", [sleeper("pc", "qwen3:8b", mac=None)]) is None
    assert choose_sleeper("qwen3:8b", sleepers, designated="pc-b") is not None
    assert choose_sleeper("qwen3:8b", sleepers, designated="x") is None
