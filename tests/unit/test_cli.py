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


def test_workers_marks_the_models_a_backend_holds_in_memory() -> None:
    from schemas.models import ModelFacts
    from schemas.queries import WorkerView
    from services.cli.main import _with_capabilities

    worker = WorkerView(
        worker_id="gpu1",
        host="pc",
        tier="gpu",
        models=["qwen3:8b", "gemma3:4b"],
        state="idle",
        last_heartbeat=0.0,
        facts=[ModelFacts(name="qwen3:8b", capabilities=["completion", "tools"])],
        resident=["qwen3:8b"],
    )
    assert _with_capabilities(worker) == ["qwen3:8b* (tools)", "gemma3:4b"]
