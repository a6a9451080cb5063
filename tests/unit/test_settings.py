from __future__ import annotations

import pytest

from services.errors import ConfigError
from services.reaper.settings import ReaperSettings
from services.router.settings import RouterSettings
from services.runtime.settings import WorkerSettings
from services.stats.settings import StatsSettings


def test_defaults_apply_when_the_environment_is_empty() -> None:
    settings = WorkerSettings.from_env({})
    assert settings.nats_url == "nats://127.0.0.1:4222"
    assert settings.ollama_host == "http://localhost:11434"
    assert settings.worker_supports == ["cpu_inference"]


def test_values_and_comma_separated_lists_are_read() -> None:
    settings = WorkerSettings.from_env(
        {
            "NATS_URL": "nats://bus:4222",
            "WORKER_ID": "mac-m2",
            "WORKER_SUPPORTS": "gpu_inference, cpu_inference",
            "WORKER_MODELS": "qwen3:8b,gemma3:12b",
            "HEARTBEAT_INTERVAL_S": "2",
        }
    )
    assert settings.nats_url == "nats://bus:4222"
    assert settings.worker_supports == ["gpu_inference", "cpu_inference"]
    assert settings.worker_models == ["qwen3:8b", "gemma3:12b"]
    assert settings.heartbeat_interval_s == 2.0
    assert RouterSettings.from_env({"GPU_MODELS": "a,b"}).gpu_models == ["a", "b"]


def test_a_missing_required_variable_is_named() -> None:
    with pytest.raises(ConfigError, match="PG_DSN is required"):
        StatsSettings.from_env({})


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"HEARTBEAT_INTERVAL_S": "soon"}, "HEARTBEAT_INTERVAL_S='soon'"),
        ({"WORKER_SUPPORTS": "cpu_inference,tpu"}, "WORKER_SUPPORTS"),
        ({"WORKER_ID": "box.lan"}, "WORKER_ID"),
        ({"HEARTBEAT_INTERVAL_S": "20", "WORKER_TTL_S": "10"}, "WORKER_TTL_S"),
        ({"LOG_FORMAT": "xml"}, "LOG_FORMAT"),
    ],
)
def test_a_malformed_value_is_refused_naming_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        WorkerSettings.from_env(env)


def test_no_route_to_host_on_macos_names_the_local_network_permission() -> None:
    from services.runtime.bus import local_network_hint

    hint = local_network_hint(65, "darwin")
    assert "System Settings → Privacy & Security → Local Network" in hint
    assert "desktop session" in hint
    assert local_network_hint(65, "linux") == ""  # errno 65 is another error on Linux
    assert local_network_hint(61, "darwin") == ""  # connection refused: no hint


@pytest.mark.parametrize("settings", [RouterSettings, ReaperSettings])
def test_gpu_preference_is_a_factor_of_at_least_one(
    settings: type[RouterSettings] | type[ReaperSettings],
) -> None:
    assert settings.from_env({}).gpu_preference == 2.0
    assert settings.from_env({"GPU_PREFERENCE": "3.5"}).gpu_preference == 3.5
    assert settings.from_env({"GPU_PREFERENCE": "inf"}).gpu_preference == float("inf")
    for bad in ("0.5", "-2", "nan", "twice"):
        with pytest.raises(ConfigError, match="GPU_PREFERENCE"):
            settings.from_env({"GPU_PREFERENCE": bad})


@pytest.mark.parametrize(
    ("settings", "env"),
    [(ReaperSettings, {}), (StatsSettings, {"PG_DSN": "postgresql://localhost/x"})],
)
def test_an_active_standby_lease_must_stay_fresh_between_two_renewals(
    settings: type[ReaperSettings] | type[StatsSettings], env: dict[str, str]
) -> None:
    """The reaper's and the stats service's leases are renewed every HEARTBEAT_INTERVAL_S and
    their holder stops acting one interval before WORKER_TTL_S: a TTL of two intervals or
    less would stop it between two renewals."""
    ok = settings.from_env({**env, "HEARTBEAT_INTERVAL_S": "1", "WORKER_TTL_S": "2.5"})
    assert (ok.heartbeat_interval_s, ok.worker_ttl_s) == (1.0, 2.5)
    for interval, ttl in (("1", "2"), ("2", "3"), ("0", "3"), ("-1", "3")):
        with pytest.raises(ConfigError, match="WORKER_TTL_S must be longer than twice"):
            settings.from_env({**env, "HEARTBEAT_INTERVAL_S": interval, "WORKER_TTL_S": ttl})


def test_a_workers_memory_is_read_in_gb_and_refused_unless_positive() -> None:
    assert WorkerSettings.from_env({}).memory_bytes is None
    assert WorkerSettings.from_env({"WORKER_MEMORY_GB": "12.5"}).memory_bytes == 12_500_000_000
    for bad in ("0", "-4", "inf", "nan"):
        with pytest.raises(ConfigError, match="WORKER_MEMORY_GB"):
            WorkerSettings.from_env({"WORKER_MEMORY_GB": bad})


def test_a_workers_watchdog_acts_before_the_reaper_may_move_its_task() -> None:
    """The watchdog's limit defaults to the TTL less a heartbeat interval, and must be shorter
    than the TTL: a stalled worker's generation has to end before its task may run elsewhere."""
    assert WorkerSettings.from_env({}).watchdog_s == 2.0
    tuned = {"HEARTBEAT_INTERVAL_S": "0.5", "WORKER_TTL_S": "3"}
    assert WorkerSettings.from_env(tuned).watchdog_s == 2.5
    assert WorkerSettings.from_env({"WORKER_WATCHDOG_S": "1.5"}).watchdog_s == 1.5
    assert WorkerSettings.from_env({"WORKER_WATCHDOG_S": "0"}).watchdog_s == 0  # none
    for bad in ("3", "4", "-1", "nan"):
        with pytest.raises(ConfigError, match="WORKER_WATCHDOG_S"):
            WorkerSettings.from_env({"WORKER_WATCHDOG_S": bad})
