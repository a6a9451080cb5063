"""A JetStream cluster's pure parts: a node's configuration, NATS_URL with several servers,
the replica refusals and the doctor's cluster checks."""

from __future__ import annotations

from typing import Any

import pytest
from nats.js.api import ClusterInfo, PeerInfo, StreamConfig, StreamInfo, StreamState

from services.cli.cluster import parse_routes, pick_node, render_cluster_conf, routes_value
from services.cli.doctor_cluster import (
    MAX_REPLICA_LAG,
    check_meta_leader,
    check_peers,
    check_stream_replicas,
    meta_from_jsz,
)
from services.cli.main import main
from services.cli.permissions import render_nats_conf
from services.cli.replication import check_replicas_possible, replication_of
from services.cli.settings import DoctorSettings
from services.errors import ConfigError
from services.runtime.settings import Settings, nats_servers


def render(node: str = "nas", routes: str = "nas,nuc:7222,pi") -> str:
    return render_cluster_conf("home", routes, node, ["cpu1"], ["search1"])


def test_each_node_gets_the_single_servers_users_its_own_name_and_routes_to_all() -> None:
    conf = render()
    single = render_nats_conf(["cpu1"], ["search1"])
    users = single[single.index("authorization {") :]
    assert conf.endswith(users)
    assert "server_name: nas\n" in conf
    assert "  name: home\n  listen: 0.0.0.0:6222\n" in conf
    assert "  routes: $CLUSTER_ROUTES\n" in conf
    assert "authorization { user: cluster, password: $CLUSTER_PASSWORD }" in conf
    assert "sync_interval: always" in conf
    assert "system_account: SYS" in conf
    for node in ("nas:6222 (nas)", "nuc:7222 (nuc-7222)", "pi:6222 (pi)"):
        assert f"  #   {node}\n" in conf
    other = render("nuc")
    assert "server_name: nuc-7222\n" in other
    assert "  listen: 0.0.0.0:7222\n" in other
    # Alike but for the name and the cluster port.
    differing = {a for a, b in zip(conf.splitlines(), other.splitlines(), strict=True) if a != b}
    assert differing == {"server_name: nas", "  listen: 0.0.0.0:6222"}


def test_the_routes_variable_carries_every_node_with_the_password() -> None:
    nodes = parse_routes("nas, nuc:7222 ,pi")
    assert routes_value(nodes, "s3cret") == (
        "[nats-route://cluster:s3cret@nas:6222, nats-route://cluster:s3cret@nuc:7222, "
        "nats-route://cluster:s3cret@pi:6222]"
    )
    assert pick_node(nodes, "nuc").address == "nuc:7222"
    assert pick_node(nodes, "nuc:7222").server_name == "nuc-7222"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--cluster", "home"], "--routes, --node missing"),
        (["--routes", "a,b,c", "--node", "a"], "--cluster missing"),
        (["--cluster", "home", "--routes", "a,b", "--node", "a"], "needs at least 3"),
        (["--cluster", "home", "--routes", "a,b,a", "--node", "a"], "names a:6222 twice"),
        (["--cluster", "home", "--routes", "a,b,c", "--node", "d"], "--node 'd' is not one"),
        (["--cluster", "home", "--routes", "a,b:0,c", "--node", "a"], "no valid port"),
        (["--cluster", "home", "--routes", "a,b_x,c", "--node", "a"], "is not host[:port]"),
        (["--cluster", "a.b", "--routes", "a,b,c", "--node", "a"], "a cluster name is"),
        (["--cluster", "h", "--routes", "a:1,a:2,b", "--node", "a"], "more than one node"),
    ],
)
def test_bad_cluster_input_exits_2_naming_the_mistake(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["deploy", "render", "nats", *argv])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_nats_url_names_one_server_or_a_cluster() -> None:
    assert nats_servers(" nats://a:4222 , tls://b:4222,") == ["nats://a:4222", "tls://b:4222"]
    assert Settings.from_env({"NATS_URL": "nats://a:1,nats://[::1]:2"}).nats_url
    for bad in ("nats://a b:4222", "http://a:4222", "nats://a:4222/x"):
        with pytest.raises(ConfigError, match=f"NATS_URL: {bad!r} is malformed"):
            Settings.from_env({"NATS_URL": f"nats://ok:4222,{bad}"})
    with pytest.raises(ConfigError, match="NATS_URL names no server"):
        Settings.from_env({"NATS_URL": " , "})
    with pytest.raises(ConfigError, match="go together"):
        DoctorSettings.from_env({"NATS_SYSTEM_USER": "system"})
    system = DoctorSettings.from_env(
        {
            "NATS_USER": "operator",
            "NATS_PASSWORD": "p",
            "NATS_SYSTEM_USER": "system",
            "NATS_SYSTEM_PASSWORD": "s",
        }
    ).system_auth()
    assert system is not None and (system.user, system.password) == ("system", "s")
    assert DoctorSettings.from_env({}).system_auth() is None


def test_replicas_a_server_cannot_keep_are_refused() -> None:
    check_replicas_possible({}, "nats://a:4222", 1)
    with pytest.raises(ConfigError, match="is a single server"):
        check_replicas_possible({}, "nats://a:4222", 3)
    clustered = {"cluster": "home", "connect_urls": ["a:4222", "b:4222", "c:4222"]}
    check_replicas_possible(clustered, "nats://a:4222", 3)
    with pytest.raises(ConfigError, match="has 3 server"):
        check_replicas_possible(clustered, "nats://a:4222", 5)


def stream(
    name: str, replicas: int, leader: str | None, peers: list[PeerInfo] | None
) -> StreamInfo:
    cluster = ClusterInfo(leader=leader, name="home", replicas=peers) if leader or peers else None
    return StreamInfo(
        config=StreamConfig(name=name, num_replicas=replicas),
        state=StreamState(messages=7, bytes=0, first_seq=1, last_seq=7, consumer_count=0),
        cluster=cluster,
    )


def peer(name: str, *, current: bool = True, offline: bool = False, lag: int = 0) -> PeerInfo:
    return PeerInfo(name=name, current=current, offline=offline or None, active=1, lag=lag)


def test_stream_replicas_are_a_problem_when_too_few_offline_behind_or_lagging() -> None:
    good = stream("EVENTS", 3, "nas", [peer("nuc"), peer("pi", lag=MAX_REPLICA_LAG)])
    assert replication_of(good).current == 3
    ok = check_stream_replicas({"EVENTS": good}, [], 3)
    assert ok.status == "ok"
    assert ok.detail == "1 streams, 3 replicas each, all current"
    bad = check_stream_replicas(
        {
            "TASKS": stream("TASKS", 1, "nas", None),
            "EVENTS": stream("EVENTS", 3, "nas", [peer("nuc", offline=True), peer("pi")]),
            "KV_stats": stream("KV_stats", 3, "nas", [peer("nuc", current=False, lag=9)]),
            "KV_asleep": stream("KV_asleep", 3, "nas", [peer("nuc"), peer("pi", lag=500)]),
            "KV_workers": stream("KV_workers", 3, None, [peer("pi")]),
        },
        ["KV_gateway_keys"],
        3,
    )
    assert bad.status == "problem"
    for said in (
        "KV_gateway_keys does not answer",
        "TASKS has 1 replica(s), the cluster can keep 3",
        "setup --replicas 3",
        "EVENTS: replica on nuc is offline",
        "KV_stats: replica on nuc is not current (9 behind)",
        "KV_stats: 1 replica(s) not placed",
        "KV_asleep: replica on pi lags 500 operations behind",
        "KV_workers has no leader",
    ):
        assert said in bad.detail


def jsz(server: str, leader: str | None, replicas: list[dict[str, Any]]) -> dict[str, Any]:
    meta = {"name": "home", "leader": leader, "replicas": replicas, "cluster_size": 3}
    return {"server": {"name": server}, "data": {"meta_cluster": meta}}


def test_the_meta_group_is_read_from_its_leaders_answer() -> None:
    replies = [
        jsz("nuc", "nas", [{"name": "nas", "current": True}, {"name": "pi", "current": False}]),
        jsz(
            "nas",
            "nas",
            [
                {"name": "nuc", "current": True, "lag": 0},
                {"name": "pi", "current": False, "offline": True},
            ],
        ),
    ]
    meta = meta_from_jsz(replies)
    assert meta is not None and meta.leader == "nas"
    assert [p.name for p in meta.peers] == ["nas", "nuc", "pi"]
    peers = check_peers(meta, "")
    assert peers.status == "problem" and peers.detail == "pi is offline"
    assert check_meta_leader(meta, "").detail == "nas"
    healthy = meta_from_jsz([jsz("nas", "nas", [{"name": "nuc", "current": True}] * 1)])
    assert healthy is not None
    assert check_peers(healthy, "").detail == "1 of 3 peer(s) unknown"

    # The leader named did not answer (it just went away): no leader to speak for the group.
    orphaned = meta_from_jsz([jsz("nuc", "gone", [{"name": "pi", "current": True}])])
    assert orphaned is not None and orphaned.leader is None
    assert check_meta_leader(orphaned, "").status == "problem"
    assert meta_from_jsz([{"server": {"name": "solo"}, "data": {}}]) is None
    assert check_peers(None, "needs the system user").status == "skipped"
