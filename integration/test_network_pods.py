"""Pods on the network through their security groups, metadata, resolver and traffic records.

A user's session with feosctl against feosd (podnet.PodNet: feosd in a namespace of its own with
--deny-prefix 203.0.113.0/24, the internet in another) and three real QEMU guests, booted side by
side once for the module:

- WEB in group "web": HTTP on 8080 (busybox httpd), which web lets in from group "client"; out to
  the internet (so, as far as web's rules go, to any pod); metadata {"role": "web"};
- CLIENT in group "client": out to group web on 8080 and to the internet, nothing in; names the
  name table "lab"; serves 8080 too, so that what does not reach it is refused by the table;
- PLAIN in the default group (out to the internet, nothing in), serving 8080 as well.

The internet namespace serves HTTP on 198.51.100.80 and on 203.0.113.7 (denied) (_netpods.py).
`feosctl --json traffic watch` runs through the whole module; its records are checked at the
end. A flow is recorded when connection tracking forgets it: a TCP connection closed by both
ends stays in TIME_WAIT for 120 s, so the flows here are the ones deleting the pods ends (their
entries deleted, their destroy events named for the pod that just left).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
from _netpods import (
    DENIED_V4,
    DENY_PREFIX,
    INTERNET_PORT,
    INTERNET_RULES,
    INTERNET_V4,
    POD_PORT,
    Internet,
    TrafficWatch,
    create_pods,
    in_pod_connect,
    in_pod_get,
    in_pod_http,
    metadata_get,
    metadata_token,
    pod_spec,
    rule,
    server_command,
)
from podnet import IMAGE, NODE_V4, PodNet

WEB, CLIENT, PLAIN = "wb0000000aa", "ct0000000bb", "df0000000cc"
TABLE_NAME = "web"  # the name of WEB in the table "lab", put when WEB has its address
DROPPED = "nc: timed out"  # no answer at all: neither a refusal nor a reset
GROUPS = {
    "web": {"id": "web", "rulesIn": [rule("tcp", {"group": "client"}, POD_PORT)],
            "rulesOut": INTERNET_RULES},
    "client": {"id": "client", "rulesIn": [],
               "rulesOut": [rule("tcp", {"group": "web"}, POD_PORT), *INTERNET_RULES]},
}


@attrs.define
class Session:
    net: PodNet
    internet: Internet
    watch: TrafficWatch
    pods: dict[str, Any]
    boot_seconds: float

    def ipv6(self, pod_id: str) -> str:
        return str(self.pods[pod_id]["ipv6Address"])


@pytest.fixture(scope="module")
def s(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    root = tmp_path_factory.mktemp("netpods")
    with PodNet(root, "--deny-prefix", DENY_PREFIX) as net:
        internet = Internet(net, root).start()
        watch = TrafficWatch(net)
        try:
            yield _session(net, internet, watch)
        finally:
            watch.close()
            internet.close()


def _session(net: PodNet, internet: Internet, watch: TrafficWatch) -> Session:
    for group in GROUPS.values():
        net.ctl("group", "put", net.spec_file(f"group-{group['id']}", group))
    net.ctl("names", "put", net.spec_file("names-lab", {
        "id": "lab", "version": 1, "names": [{"name": "db", "addresses": ["fd00:db8:1::db", "198.51.100.99"]}]}))
    started = time.monotonic()
    pods = create_pods(net, {
        WEB: pod_spec(IMAGE, server_command("hello-from-web"), groups=["web"],
                      metadata={"role": "web", "tier": {"name": "front"}}),
        CLIENT: pod_spec(IMAGE, server_command("hello-from-client"), groups=["client"],
                         names=["lab"], metadata={"role": "client"}),
        PLAIN: pod_spec(IMAGE, server_command("hello-from-plain")),
    })
    return Session(net, internet, watch, pods, time.monotonic() - started)


def test_the_pods_run_in_their_groups(s: Session) -> None:
    print(f"three pods booted side by side in {s.boot_seconds:.1f}s")
    listed = {g["id"]: g for g in s.net.ctl_json("group", "list")}
    assert listed["web"]["rulesIn"][0]["peer"] == {"group": "client"}
    assert "tcp:8080 group web" in s.net.ctl("group", "get", "client").stdout
    for pod_id, groups in ((WEB, ["web"]), (CLIENT, ["client"]), (PLAIN, [])):
        pod = s.net.ctl_json("pod", "get", pod_id)
        assert pod["state"] == "running", pod
        assert pod["spec"]["network"]["pod"].get("securityGroups", []) == groups
        # each listens (of both families): what does not reach it is the network's doing. (Not
        # asked over its loopback: the guest leaves lo down.)
        listening = s.net.exec(pod_id, "busybox", "netstat", "-ltn").stdout
        assert f":::{POD_PORT} " in listening, listening
    # a group a pod names is not deleted
    refused = s.net.ctl("group", "delete", "web", check=False)
    assert refused.returncode != 0 and "web" in refused.stderr


def test_the_client_reaches_web_over_ipv6(s: Session) -> None:
    assert in_pod_get(s.net, CLIENT, s.ipv6(WEB)) == "hello-from-web\n"


def test_web_does_not_reach_the_client(s: Session) -> None:
    # web's rules out let it go; no rule of client's lets it in
    assert in_pod_connect(s.net, WEB, s.ipv6(CLIENT)) == DROPPED


def test_the_default_group_reaches_the_internet_and_nothing_reaches_it(s: Session) -> None:
    assert in_pod_get(s.net, PLAIN, INTERNET_V4, INTERNET_PORT) == "hello from the internet\n"
    assert NODE_V4 in s.internet.clients()  # its IPv4 left the node masqueraded
    assert in_pod_connect(s.net, CLIENT, s.ipv6(PLAIN)) == DROPPED  # client may go out; plain lets none in
    assert in_pod_connect(s.net, PLAIN, s.ipv6(WEB)) == DROPPED  # web lets in the client group only


def test_a_denied_prefix_is_not_reached(s: Session) -> None:
    assert s.internet.node_reaches(DENIED_V4)  # the node itself reaches it: the pods' table denies
    assert in_pod_connect(s.net, PLAIN, DENIED_V4, INTERNET_PORT) == DROPPED
    assert in_pod_connect(s.net, CLIENT, DENIED_V4, INTERNET_PORT) == DROPPED  # out to 0.0.0.0/0 too
    assert in_pod_get(s.net, CLIENT, INTERNET_V4, INTERNET_PORT) == "hello from the internet\n"


def test_metadata_from_inside(s: Session) -> None:
    for pod_id, role in ((WEB, "web"), (CLIENT, "client")):
        token = metadata_token(s.net, pod_id, ttl=120)
        assert metadata_get(s.net, pod_id, "/feos/ipv6", token) == s.ipv6(pod_id)
        assert metadata_get(s.net, pod_id, "/feos/pod-id", token) == pod_id
        assert metadata_get(s.net, pod_id, "/metadata/role", token) == role
        status, _ = in_pod_http(s.net, pod_id, "GET", "169.254.169.254", "/feos/ipv6", {})
        assert status == 401
        status, _ = in_pod_http(s.net, pod_id, "GET", "169.254.169.254", "/feos/ipv6",
                                {"X-metadata-token": "not-a-token"})
        assert status == 401
    token = metadata_token(s.net, WEB)
    assert metadata_get(s.net, WEB, "/metadata", token) == "role\ntier/"
    assert json.loads(s.net.exec(WEB, "busybox", "wget", "-q", "-O-", "--header", f"X-metadata-token: {token}",
                                 "--header", "Accept: application/json",
                                 "http://169.254.169.254/metadata/tier").stdout) == {"name": "front"}


def nslookup(s: Session, pod_id: str, qtype: str, name: str) -> str:
    """busybox nslookup of one type. (Not both at once: busybox 1.35 gives its A and AAAA
    queries one ID and matches answers by ID alone, taking whichever comes first for A's.)"""
    return s.net.exec(pod_id, "busybox", "nslookup", f"-type={qtype}", name, check=False).stdout


def test_the_resolver_answers_the_pods_name_table(s: Session) -> None:
    # the table gets WEB's name now that WEB has its address; the pod sees it at once
    s.net.ctl("names", "update", "lab", "--from", "1", "--to", "2",
              "--put", f"{TABLE_NAME}={s.ipv6(WEB)}")
    found = nslookup(s, CLIENT, "AAAA", TABLE_NAME)
    assert f"Address: {s.ipv6(WEB)}" in found, found
    assert "Address: fd00:db8:1::db" in nslookup(s, CLIENT, "AAAA", "DB")  # in any case
    assert "Address: 198.51.100.99" in nslookup(s, CLIENT, "A", "db")
    # a pod that names no table is not answered from it (the name goes upstream)
    assert s.ipv6(WEB) not in nslookup(s, PLAIN, "AAAA", TABLE_NAME)


def drop_of(pod_id: str, reason: str, src: str, dst: str) -> Callable[[dict[str, Any]], bool]:
    """A match for a TCP drop record: its pod, reason, source (a prefix) and destination."""
    def match(r: dict[str, Any]) -> bool:
        d = r.get("drop") or {}
        return bool(d) and (d["podId"], d["reason"], d["protocol"], d["destination"]) == \
            (pod_id, reason, 6, dst) and str(d["source"]).startswith(src)
    return match


def v6(address: str, port: int) -> str:
    return f"[{address}]:{port}"


def test_traffic_records_name_the_pods(s: Session) -> None:
    web, client, plain = s.ipv6(WEB), s.ipv6(CLIENT), s.ipv6(PLAIN)
    plain4 = s.pods[PLAIN]["ipv4Address"]
    # each refused SYN, named for the pod whose chain dropped it: the receiver's for want of a
    # rule in, the sender's for a denied destination
    for pod_id, reason, src, dst, what in (
        (CLIENT, "no-rule", f"[{web}]:", v6(client, POD_PORT), "web's attempt to the client"),
        (PLAIN, "no-rule", f"[{client}]:", v6(plain, POD_PORT), "the client's attempt to plain"),
        (WEB, "no-rule", f"[{plain}]:", v6(web, POD_PORT), "plain's attempt to web"),
        (PLAIN, "deny", f"{plain4}:", f"{DENIED_V4}:{INTERNET_PORT}", "plain's to the denied"),
        (CLIENT, "deny", f"{s.pods[CLIENT]['ipv4Address']}:", f"{DENIED_V4}:{INTERNET_PORT}",
         "the client's attempt to the denied prefix"),
    ):
        s.watch.wait_for(drop_of(pod_id, reason, src, dst), what)
    # the client's request to web, its Host read from the first packets
    s.watch.wait_for(lambda r: r.get("serverName") == {
        "podId": CLIENT, "kind": "http", "name": web, "destination": v6(web, POD_PORT)},
        "the Host of the client's request to web")
    query = s.watch.wait_for(
        lambda r: r.get("dnsQuery", {}).get("name") == f"{TABLE_NAME}."
        and r["dnsQuery"]["podId"] == CLIENT and r["dnsQuery"]["type"] == 28,
        "the client's lookup")["dnsQuery"]
    assert query["answers"] == [f"AAAA {web}"]
    assert (query["rcode"], query["upstream"]) == (0, "")  # answered from the name table


def test_deleting_the_pods_ends_their_flows_in_records(s: Session) -> None:
    s.net.ctl("pod", "delete", CLIENT)
    flow = s.watch.wait_for(
        lambda r: r.get("flow", {}).get("podId") == CLIENT
        and r["flow"]["destination"] == v6(s.ipv6(WEB), POD_PORT),
        "the client's connection to web")["flow"]
    assert flow["source"].startswith(f"[{s.ipv6(CLIENT)}]:")
    assert flow["protocol"] == 6 and flow["event"] == "destroy"
    assert flow["bytesIn"] > len("hello-from-web") and flow["packetsOut"] >= 3
    s.net.ctl("pod", "delete", PLAIN)
    out = s.watch.wait_for(
        lambda r: r.get("flow", {}).get("podId") == PLAIN
        and r["flow"]["destination"] == f"{INTERNET_V4}:{INTERNET_PORT}",
        "plain's connection to the internet")["flow"]
    assert out["source"].startswith(f"{s.pods[PLAIN]['ipv4Address']}:")
    # the pods' queries to the resolver are the DNS records', never flows (their conntrack
    # entries ended with the pods too)
    assert not [r for r in s.watch.records if r.get("flow", {}).get("destination") == "169.254.0.53:53"]
    s.net.ctl("pod", "delete", WEB)
    assert s.net.ctl_json("pod", "list") == []
    assert not [name for name in s.net.links() if name.startswith("pod-")]
    assert s.net.qemus() == {}
    table = subprocess.run(s.net.in_node("nft", "-j", "list", "table", "inet", "feos"),
                           capture_output=True, text=True, check=True).stdout
    chains = [c["chain"]["name"] for c in json.loads(table)["nftables"] if "chain" in c]
    assert not [c for c in chains if c.startswith(("out-", "in-"))]
    # the groups and the table are the node's until they are deleted, now that no pod names them
    for group in GROUPS:
        s.net.ctl("group", "delete", group)
    s.net.ctl("names", "delete", "lab")
