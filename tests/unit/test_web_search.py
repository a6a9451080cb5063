"""The web-search service's pure parts: query, parsing, failures, prompt, fallback, takeover."""

from __future__ import annotations

import json
from typing import Any

import pytest

from devtools.fakes.searxng import results_for
from schemas.events import TaskStarted
from schemas.route import DEFAULT_MODEL, Source
from schemas.tasks import TaskMessage, is_retryable
from schemas.work import Work
from schemas.workers import WorkerRecord
from services.cli.main import main
from services.errors import (
    ConfigError,
    NoResults,
    SearchError,
)
from services.fleet.takeover import MIN_RECHECK_S, Lost, Run, Wait, on_redelivery
from services.runtime.settings import WebSearchSettings, default_worker_id
from services.web_search.search import (
    SNIPPET_CHARS,
    clean,
    failure_for_status,
    is_json,
    not_json,
    parse_results,
    search_params,
)
from services.web_search.summary import (
    MIN_SUMMARY_S,
    fallback_note,
    fallback_response,
    is_served,
    summary_budget,
    summary_model,
    summary_prompt,
)

ADDRESS = "http://search.lan:8080"


def reply(results: list[dict[str, Any]], **extra: Any) -> bytes:
    """A SearXNG JSON reply with the fields a real one has."""
    body = {
        "query": "q",
        "number_of_results": 0,
        "results": results,
        "answers": [],
        "corrections": [],
        "infoboxes": [],
        "suggestions": [],
        "unresponsive_engines": [],
        **extra,
    }
    return json.dumps(body).encode()


# -- the query ---------------------------------------------------------------------------------


def test_search_params_ask_for_json_and_only_what_is_set() -> None:
    assert search_params("nats jetstream") == {"q": "nats jetstream", "format": "json"}
    assert search_params("x", categories=["news", "it"], language="de") == {
        "q": "x",
        "format": "json",
        "categories": "news,it",
        "language": "de",
    }


# -- parsing -----------------------------------------------------------------------------------


def test_the_top_results_become_sources_in_order() -> None:
    sources = parse_results(
        reply(results_for("nats jetstream", 8)), query="nats jetstream", limit=3, address=ADDRESS
    )
    assert [s.url for s in sources] == [
        f"https://example.org/nats-jetstream/{i}" for i in (1, 2, 3)
    ]
    assert sources[0].title == "nats jetstream - result 1"
    assert sources[0].snippet.startswith("Snippet 1 about nats jetstream")


def test_results_without_an_address_or_repeated_are_skipped_and_text_is_tidied() -> None:
    results: list[dict[str, Any]] = [
        {"url": "", "title": "no address"},
        {"url": "https://a.example/1", "title": "  A\n  title ", "content": "x " * 400},
        {"url": "https://a.example/1", "title": "duplicate"},
        {"url": "https://b.example/2", "title": None, "content": None},
    ]
    sources = parse_results(reply(results), query="q", limit=5, address=ADDRESS)
    assert [s.url for s in sources] == ["https://a.example/1", "https://b.example/2"]
    assert sources[0].title == "A title"
    assert len(sources[0].snippet) == SNIPPET_CHARS and sources[0].snippet.endswith("…")
    assert sources[1] == Source(title="https://b.example/2", url="https://b.example/2", snippet="")


def test_no_results_is_a_failure_naming_the_engines_that_did_not_answer() -> None:
    body = reply([], unresponsive_engines=[["brave", "too many requests"], ["google", "timeout"]])
    with pytest.raises(NoResults) as info:
        parse_results(body, query="obscure thing", limit=5, address=ADDRESS)
    assert info.value.code == "no_results"
    assert "'obscure thing'" in info.value.message
    assert "brave (too many requests), google (timeout)" in info.value.message
    with pytest.raises(NoResults, match=r"no results for 'x'$"):
        parse_results(reply([]), query="x", limit=5, address=ADDRESS)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"<!DOCTYPE html><html>", "not JSON"),
        (b"[1, 2]", "unexpected shape"),
        (b'{"results": [{"url": 3}]}', "unexpected shape"),
    ],
)
def test_a_body_that_is_not_searxngs_json_is_a_search_error(body: bytes, says: str) -> None:
    with pytest.raises(SearchError, match=says) as info:
        parse_results(body, query="q", limit=5, address=ADDRESS)
    assert info.value.code == "search_error"
    assert ADDRESS in info.value.message


def test_not_json_says_what_came_instead() -> None:
    error = not_json(ADDRESS, "text/html; charset=utf-8", b"<html><title>Login</title>")
    assert "text/html" in error.message
    assert "<html><title>Login" in error.message
    assert "SEARXNG_URL" in error.message
    assert is_json("application/json; charset=utf-8")
    assert not is_json("text/html")


HTML = "text/html"


@pytest.mark.parametrize(
    ("status", "content_type", "body", "code", "says"),
    [
        (429, "text/plain", b"Too Many Requests", "search_rate_limited", "429"),
        (500, "application/json", b'{"error": "search error"}', "search_error", "search error"),
        (502, HTML, b"<html>bad gateway</html>", "search_unavailable", "502"),
        (503, HTML, b"<html></html>", "search_unavailable", "503"),
        (403, HTML, b"<html>Forbidden</html>", "search_error", "search.formats"),
        (404, HTML, b"<html></html>", "search_error", "HTTP 404"),
    ],
)
def test_http_failures_map_to_search_errors_with_codes(
    status: int, content_type: str, body: bytes, code: str, says: str
) -> None:
    error = failure_for_status(status, content_type, body, ADDRESS)
    assert isinstance(error, SearchError)
    assert error.code == code
    assert error.retryable == (code != "search_error")
    assert says in error.message
    assert ADDRESS in error.message
    assert "<html>" not in error.message  # pages are not pasted into reasons


# -- the summary -------------------------------------------------------------------------------

SOURCES = [
    Source(title="NATS Docs", url="https://docs.nats.io/js", snippet="JetStream persists."),
    Source(title="Blog", url="https://blog.example/nats", snippet=""),
]


def test_the_prompt_holds_the_question_and_numbered_sources_to_cite() -> None:
    prompt = summary_prompt("  What is JetStream? ", SOURCES)
    assert "Question: What is JetStream?\n" in prompt
    assert "[1] NATS Docs\nhttps://docs.nats.io/js\nJetStream persists." in prompt
    assert "[2] Blog\nhttps://blog.example/nats\n\nAnswer:" in prompt
    assert "[1]" in prompt.split("Question:")[0]  # the instructions show how to cite
    assert prompt.endswith("Answer:")


def test_the_fallback_is_a_numbered_list_and_the_note_says_why() -> None:
    assert fallback_response(SOURCES) == (
        "1. NATS Docs\n   https://docs.nats.io/js\n   JetStream persists.\n"
        "2. Blog\n   https://blog.example/nats"
    )
    note = fallback_note("backend_timeout", "Ollama did not finish within 20 s")
    assert note.startswith("the summary failed (backend_timeout: Ollama did not finish")
    assert "plain list of search results" in note


def test_the_summary_model_is_the_requested_one_unless_it_asks_for_the_default() -> None:
    assert summary_model(DEFAULT_MODEL, "qwen2.5:0.5b") == "qwen2.5:0.5b"
    assert summary_model("gemma3:1b", "qwen2.5:0.5b") == "gemma3:1b"
    assert is_served("qwen2.5:0.5b", ["qwen2.5:0.5b"])
    assert is_served("llama3", ["llama3:latest"])
    assert not is_served("llama3:8b", ["llama3:latest"])


def test_the_summary_gets_what_is_left_of_the_tasks_time() -> None:
    assert summary_budget(task_timeout_s=300, elapsed_s=2, summary_timeout_s=60) == 60
    assert summary_budget(task_timeout_s=30, elapsed_s=10, summary_timeout_s=60) == 20
    assert summary_budget(task_timeout_s=30, elapsed_s=10, summary_timeout_s=0.5) == 0.5
    assert (
        summary_budget(task_timeout_s=30, elapsed_s=30 - MIN_SUMMARY_S / 2, summary_timeout_s=60)
        == 0
    )


def test_clean_collapses_whitespace_and_cuts() -> None:
    assert clean(" a\n\tb  ", 10) == "a b"
    assert clean(None, 10) == ""
    assert clean("abcdefghijkl", 5) == "abcd…"


# -- a redelivered task (takeover) -------------------------------------------------------------

NOW = 1_800_000_000.0
STARTED = TaskStarted(at=NOW - 40, task_id="t1", attempt=1, worker="web-a", host="box-a")


def record(**fields: Any) -> WorkerRecord:
    base: dict[str, Any] = {
        "worker_id": "web-a",
        "host": "box-a",
        "instance_id": "i1",
        "pid": 10,
        "version": "0",
        "supports": ["web_search"],
        "models": ["m"],
        "started_at": NOW - 100,
        "heartbeat_at": NOW - 2,
        "state": "busy",
        "current_task": "t1",
    }
    return WorkerRecord(**{**base, **fields})


def test_a_task_nobody_started_is_run() -> None:
    assert on_redelivery(None, None, now=NOW, ttl_s=15) == Run()


def test_a_task_whose_starter_is_alive_and_on_it_waits_until_its_heartbeat_would_be_stale() -> None:
    assert on_redelivery(STARTED, record(), now=NOW, ttl_s=15) == Wait(delay_s=13)
    almost = on_redelivery(STARTED, record(heartbeat_at=NOW - 14.9), now=NOW, ttl_s=15)
    assert almost == Wait(delay_s=MIN_RECHECK_S)


@pytest.mark.parametrize(
    "starter",
    [
        None,  # its entry is gone
        record(heartbeat_at=NOW - 16),  # silent for longer than the TTL
        record(current_task=None),  # alive, but no longer on it (restarted, or gave it up)
        record(current_task="t2"),
        record(state="stopping"),
    ],
)
def test_a_task_whose_starter_is_gone_is_lost_naming_worker_and_host(
    starter: WorkerRecord | None,
) -> None:
    decision = on_redelivery(STARTED, starter, now=NOW, ttl_s=15)
    assert isinstance(decision, Lost)
    assert "web worker 'web-a' on host box-a started this task at 2027-01-15T07:59:20Z" in (
        decision.reason
    )
    assert "(attempt 1)" in decision.reason
    assert "not run twice" in decision.reason


# -- wire and settings -------------------------------------------------------------------------


def test_web_search_tasks_are_not_retryable() -> None:
    assert not is_retryable("web_search")
    assert is_retryable("inference")
    work = Work(prompt="p", task_type="web_search")
    message = TaskMessage(task_id="t", attempt=1, model="m", timeout_s=1, submitted_at=0, work=work)
    assert not message.retryable


def test_web_search_settings_defaults_and_environment() -> None:
    settings = WebSearchSettings.from_env({})
    assert settings.searxng_url == "http://localhost:8080"
    assert settings.searxng_results == 5
    assert settings.searxng_categories == []
    assert settings.searxng_language is None
    assert settings.summary_backend == "ollama"
    # Not the inference worker's default id: both may run on one host.
    assert settings.worker_id == f"{default_worker_id()}-web"

    settings = WebSearchSettings.from_env(
        {
            "SEARXNG_URL": "https://search.lan/searxng",
            "SEARXNG_CATEGORIES": "news, it",
            "SEARXNG_LANGUAGE": "ja",
            "SEARXNG_RESULTS": "3",
            "OLLAMA_HOST": "http://mac.lan:11434",
            "OLLAMA_MODEL": "qwen3:8b",
            "SUMMARY_TIMEOUT_S": "12.5",
            "SEARCH_TIMEOUT_S": "4",
            "WORKER_ID": "web-mac",
            "WORKER_HOST": "mac.lan",
        }
    )
    assert settings.searxng_url == "https://search.lan/searxng"
    assert settings.searxng_categories == ["news", "it"]
    assert settings.searxng_language == "ja"
    assert settings.searxng_results == 3
    assert (settings.ollama_host, settings.ollama_model) == ("http://mac.lan:11434", "qwen3:8b")
    assert (settings.summary_timeout_s, settings.search_timeout_s) == (12.5, 4.0)
    assert (settings.worker_id, settings.worker_host) == ("web-mac", "mac.lan")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SEARXNG_URL": "search.lan:8080"}, "SEARXNG_URL"),
        ({"SEARXNG_RESULTS": "0"}, "SEARXNG_RESULTS"),
        ({"SEARXNG_RESULTS": "many"}, "SEARXNG_RESULTS"),
        ({"SUMMARY_TIMEOUT_S": "0"}, "SUMMARY_TIMEOUT_S"),
        ({"SEARCH_TIMEOUT_S": "-1"}, "SEARCH_TIMEOUT_S"),
        ({"SUMMARY_BACKEND": "llamafile"}, "SUMMARY_BACKEND"),
        ({"WORKER_ID": "web"}, "WORKER_ID"),
        ({"HEARTBEAT_INTERVAL_S": "20", "WORKER_TTL_S": "10"}, "WORKER_TTL_S"),
        ({"ACK_WAIT_S": "4", "HEARTBEAT_INTERVAL_S": "5"}, "ACK_WAIT_S"),
    ],
)
def test_a_malformed_web_search_setting_is_refused_naming_it(
    env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        WebSearchSettings.from_env(env)


def test_coordinator_web_search_with_a_malformed_setting_exits_2_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SEARXNG_URL", "search.lan")
    with pytest.raises(SystemExit) as exit_info:
        main(["web-search"])
    assert exit_info.value.code == 2
    assert "error config: SEARXNG_URL='search.lan' is malformed" in capsys.readouterr().err
