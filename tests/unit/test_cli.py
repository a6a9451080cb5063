from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli.main import main


def test_schemas_export_writes_one_json_schema_per_wire_type(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["schemas", "export", str(tmp_path)])
    assert exit_info.value.code == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "RouteRequest.json" in names
    assert "TaskEvent.json" in names
    route = json.loads((tmp_path / "RouteRequest.json").read_text())
    request = route["$defs"]["RouteRequest"]
    assert set(request["required"]) == {"prompt", "model"}
    events = json.loads((tmp_path / "TaskEvent.json").read_text())
    tags = {
        d["properties"]["type"]["enum"][0]
        for d in events["$defs"].values()
        if "type" in d.get("properties", {})
    }
    assert {"submitted", "routed", "started", "completed", "failed"} <= tags


def test_a_config_error_exits_2_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PG_DSN", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["stats", "serve"])
    assert exit_info.value.code == 2
    assert "error config: PG_DSN is required" in capsys.readouterr().err
