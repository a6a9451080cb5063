"""NATS credentials and the trace exporter, as the environment sets them."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.settings import SetupSettings
from services.errors import ConfigError
from services.router.settings import RouterSettings
from services.runtime.settings import NatsAuth
from services.runtime.tracing import exporter_name


def test_credentials_are_read_and_passed_on(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    settings = RouterSettings.from_env(
        {"NATS_USER": "router", "NATS_PASSWORD": "s3cret", "NATS_TLS_CA": str(ca)}
    )
    assert settings.nats_auth() == NatsAuth(user="router", password="s3cret", tls_ca=str(ca))
    assert RouterSettings.from_env({}).nats_auth() == NatsAuth()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"NATS_USER": "router"}, "NATS_USER and NATS_PASSWORD go together"),
        ({"NATS_TOKEN": "t", "NATS_USER": "u", "NATS_PASSWORD": "p"}, "set one of"),
        ({"NATS_CREDS": "/nowhere/user.creds"}, "NATS_CREDS='/nowhere/user.creds': no such file"),
        ({"NATS_TLS_CERT": "/x.pem"}, "NATS_TLS_CERT and NATS_TLS_KEY go together"),
        ({"WORKER_TTL_S": "0"}, "WORKER_TTL_S must be positive"),
    ],
)
def test_credentials_that_cannot_work_stop_the_start_naming_the_variable(
    env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        SetupSettings.from_env(env)


def test_the_exporter_follows_the_standard_variables() -> None:
    assert exporter_name({}) == "none"
    assert exporter_name({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}) == "otlp"
    assert exporter_name({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == (
        "otlp"
    )
    assert exporter_name({"OTEL_TRACES_EXPORTER": "console"}) == "console"
    assert exporter_name({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) == (
        "none"
    )
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        exporter_name({"OTEL_TRACES_EXPORTER": "zipkin"})
