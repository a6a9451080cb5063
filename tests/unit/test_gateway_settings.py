"""``coordinator gateway``'s settings: from the environment, checked at start."""

from __future__ import annotations

import pytest

from services.errors import ConfigError
from services.gateway.settings import GatewaySettings


def test_defaults_listen_on_loopback_port_11400() -> None:
    settings = GatewaySettings.from_env({})
    assert (settings.gateway_host, settings.gateway_port) == ("127.0.0.1", 11400)
    assert settings.gateway_task_timeout_s is None


def test_the_environment_sets_host_port_and_timeouts() -> None:
    settings = GatewaySettings.from_env(
        {"GATEWAY_HOST": "0.0.0.0", "GATEWAY_PORT": "8080", "GATEWAY_TASK_TIMEOUT_S": "30"}
    )
    assert (settings.gateway_host, settings.gateway_port) == ("0.0.0.0", 8080)
    assert settings.gateway_task_timeout_s == 30.0


@pytest.mark.parametrize(
    ("variable", "value"),
    [("GATEWAY_PORT", "http"), ("GATEWAY_PORT", "70000"), ("GATEWAY_TASK_TIMEOUT_S", "0")],
)
def test_a_bad_value_names_its_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as error:
        GatewaySettings.from_env({variable: value})
    assert variable in error.value.message
