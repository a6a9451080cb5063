"""What ``coordinator up``'s banner prints works as printed: the command by a path any shell
runs, the gateway's URL as this machine reaches it, a model the local worker serves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.cli.stack import coordinator_command, local_url, model_to_try


def test_the_command_is_the_running_executable_by_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "coordinator").write_text("#!/bin/sh\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["venv/bin/coordinator", "up"])  # as ./scripts/up runs it

    assert coordinator_command(tmp_path / ".coordinator") == f"{tmp_path}/venv/bin/coordinator"
    assert coordinator_command(Path(".coordinator")) == f"{tmp_path}/venv/bin/coordinator"


def test_a_home_other_than_the_default_goes_before_it_quoted_for_a_shell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "coordinator").write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "coordinator"), "up"])

    assert coordinator_command(tmp_path / "my stack") == (
        f"COORDINATOR_HOME='{tmp_path}/my stack' {tmp_path}/coordinator"
    )


def test_run_as_a_module_the_command_is_python_dash_m(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for argv0 in ("/src/services/cli/main.py", "-c"):
        monkeypatch.setattr(sys, "argv", [argv0, "up"])
        assert coordinator_command(tmp_path / ".coordinator") == (
            f"{sys.executable} -m services.cli.main"
        )


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:11400"),
        ("localhost", "http://localhost:11400"),
        ("nas.local", "http://nas.local:11400"),
        ("0.0.0.0", "http://127.0.0.1:11400"),
        ("", "http://127.0.0.1:11400"),
        ("::", "http://[::1]:11400"),
        ("::1", "http://[::1]:11400"),
        ("fd00::7", "http://[fd00::7]:11400"),
    ],
)
def test_the_gateway_url_is_one_this_machine_reaches(host: str, url: str) -> None:
    assert local_url(host, 11400) == url


def test_the_example_names_a_model_the_local_worker_serves() -> None:
    assert model_to_try(["qwen3:8b", "gemma3:1b"], []) == "qwen3:8b"
    assert model_to_try(["qwen3:8b", "gemma3:1b"], ["gemma3:1b"]) == "gemma3:1b"
    assert model_to_try(["qwen3:8b"], ["llama3:8b"]) == "MODEL"
    assert model_to_try([], []) == "MODEL"
