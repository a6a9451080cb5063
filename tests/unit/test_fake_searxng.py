"""The SearXNG stand-in itself: the JSON shape, the failure modes, knobs, and the command line."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from devtools.fakes.searxng import FakeSearxng

REPO = Path(__file__).resolve().parents[2]
RESULT_FIELDS = {
    "url", "title", "content", "engine", "engines", "positions", "score", "category",
    "template", "parsed_url", "publishedDate",
}  # fmt: skip


@pytest.fixture
def fake() -> Iterator[FakeSearxng]:
    with FakeSearxng() as server:
        yield server


@pytest.fixture
def client(fake: FakeSearxng) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake.url, timeout=10) as http:
        yield http


def search(client: httpx.Client, **params: str) -> httpx.Response:
    return client.get("/search", params={"format": "json", **params})


def test_json_search_has_searxngs_shape(fake: FakeSearxng, client: httpx.Client) -> None:
    reply = search(client, q="nats jetstream", categories="it", language="de")
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert set(body) == {
        "query", "number_of_results", "results", "answers", "corrections", "infoboxes",
        "suggestions", "unresponsive_engines",
    }  # fmt: skip
    assert body["query"] == "nats jetstream"
    assert len(body["results"]) == 8
    first = body["results"][0]
    assert set(first) >= RESULT_FIELDS
    assert first["url"] == "https://example.org/nats-jetstream/1"
    assert first["parsed_url"][:3] == ["https", "example.org", "/nats-jetstream/1"]
    assert first["category"] == "it"
    scores = [r["score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert fake.stats()["last_params"] == {
        "q": "nats jetstream", "format": "json", "categories": "it", "language": "de",
    }  # fmt: skip
    # POST with a form body works as GET does.
    posted = client.post("/search", data={"q": "nats", "format": "json"})
    assert posted.json()["results"][0]["url"] == "https://example.org/nats/1"


def test_searxngs_own_refusals(fake: FakeSearxng, client: httpx.Client) -> None:
    empty = search(client, q="")
    assert (empty.status_code, empty.json()) == (400, {"error": "No query"})
    html = client.get("/search", params={"q": "x"})
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    fake.json_enabled = False
    forbidden = search(client, q="x")
    assert forbidden.status_code == 403
    assert forbidden.headers["content-type"].startswith("text/html")
    assert client.get("/healthz").text == "OK"
    assert "general" in client.get("/config").json()["categories"]
    assert fake.stats()["search_calls"] == 1  # refusals before a search are not searches


def test_modes_empty_and_not_json(fake: FakeSearxng, client: httpx.Client) -> None:
    fake.mode = "empty"
    body = search(client, q="x").json()
    assert body["results"] == []
    assert ["brave", "too many requests"] in body["unresponsive_engines"]
    fake.configure(mode="not_json")
    page = search(client, q="x")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.text.startswith("<!DOCTYPE html>")
    fake.configure(mode="ok", result_count=2)
    assert len(search(client, q="x").json()["results"]) == 2


@pytest.mark.parametrize(
    ("status", "content_type", "says"),
    [
        (429, "text/plain", "Too Many Requests"),
        (500, "application/json", "search error"),
        (502, "text/html", "502 Bad Gateway"),
        (503, "text/html", "503 Service Temporarily Unavailable"),
        (504, "text/html", "504 Gateway Time-out"),
    ],
)
def test_fail_status_answers_as_searxng_or_its_proxy_does(
    status: int, content_type: str, says: str, fake: FakeSearxng, client: httpx.Client
) -> None:
    fake.fail_status = status
    reply = search(client, q="x")
    assert reply.status_code == status
    assert reply.headers["content-type"].startswith(content_type)
    assert says in reply.text


def test_knobs_over_http_and_reset(fake: FakeSearxng, client: httpx.Client) -> None:
    config = client.post("/_fake/config", json={"fail_status": 429, "delay_s": 0.1})
    assert config.status_code == 200
    assert (fake.fail_status, fake.delay_s) == (429, 0.1)
    assert client.post("/_fake/config", json={"mode": "weird"}).status_code == 400
    assert client.post("/_fake/config", json={"no_such_knob": 1}).status_code == 400
    assert client.post("/_fake/config", json={"fail_status": 200}).status_code == 400
    search(client, q="x")
    assert client.get("/_fake/stats").json()["search_calls"] == 1
    reset = client.post("/_fake/reset").json()
    assert reset["fail_status"] is None and reset["delay_s"] == 0
    assert client.get("/_fake/stats").json()["search_calls"] == 0


def test_delay_and_a_client_hanging_up(fake: FakeSearxng) -> None:
    fake.delay_s = 0.3
    with httpx.Client(base_url=fake.url, timeout=5) as http:
        began = time.monotonic()
        assert search(http, q="x").status_code == 200
        assert time.monotonic() - began >= 0.3
    fake.delay_s = 5
    with (
        httpx.Client(base_url=fake.url, timeout=0.2) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        search(http, q="x")
    deadline = time.monotonic() + 2
    while fake.stats()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.stats()["in_flight"] == 0


def test_stop_frees_the_port_and_cuts_keep_alive() -> None:
    fake = FakeSearxng().start()
    with httpx.Client(base_url=fake.url, timeout=5) as http:
        assert search(http, q="x").status_code == 200
        fake.stop()
        with pytest.raises(httpx.TransportError):
            search(http, q="x")


def test_runs_as_a_command() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "devtools.fakes.searxng", "--port", "0", "--mode", "empty"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("fake searxng listening on http://127.0.0.1:")
        url = line.split()[-1]
        body = httpx.get(f"{url}/search", params={"q": "x", "format": "json"}).json()
        assert body["results"] == []
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    assert proc.returncode == 0
