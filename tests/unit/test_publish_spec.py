"""Published ports at the edges: feosctl's --publish, the spec's checks, overlaps, who holds a
port (the /proc/net tables) and the network's check_spec at create."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

import pytest

from feos.cli._commands import UsageError
from feos.cli._pods import _with_publish, parse_publish, publish_text
from feos.errors import Code, FeosError
from feos.net import PodNet, PublishedPort
from feos.net._options import parse_network_options
from feos.net._ports import Listener, _parse_proc, holder_of_port, overlaps, read_listeners
from feos.net._service import Network
from feos.pods._spec import parse_spec

OPTIONS = parse_network_options(pod_prefix="2001:db8:1::/64")
NODE4, NODE6 = ipaddress.ip_address("192.0.2.1"), ipaddress.ip_address("2001:db8:ffff::1")


def spec(*publish: dict[str, Any]) -> dict[str, Any]:
    return {"containers": [{"name": "web", "image": "busybox"}],
            "network": {"pod": {"publish": list(publish)}}}


def port(host: int, pod: int = 80, address: str = "", protocol: str = "tcp") -> dict[str, Any]:
    return {"protocol": protocol, "hostAddress": address, "hostPort": host, "podPort": pod}


# --- feosctl ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "want"), [
    ("8080:80", port(8080)),
    ("8080:80/udp", port(8080, protocol="udp")),
    ("127.0.0.1:8080:80", port(8080, address="127.0.0.1")),
    ("[::1]:5353:53/udp", port(5353, 53, "::1", "udp")),
    ("[2001:db8::1]:443:8443/tcp", port(443, 8443, "2001:db8::1")),
])
def test_publish_text_as_docker_takes_it(text: str, want: dict[str, Any]) -> None:
    assert parse_publish(text) == want


@pytest.mark.parametrize("text", ["80", "a:80:80", "::1:80:80", "80:80/sctp", "80:80:80:80"])
def test_bad_publish_text_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError):
        parse_publish(text)


@pytest.mark.parametrize("text", ["8080:80/tcp", "127.0.0.1:8080:80/tcp", "[::1]:5353:53/udp"])
def test_pod_get_shows_a_publish_as_it_was_given(text: str) -> None:
    assert publish_text(parse_publish(text)) == text
    assert publish_text({"hostPort": 80, "podPort": 8080}) == "80:8080/tcp"  # as the wire has it


def test_spec_file_strings_and_flags_are_one_list() -> None:
    got = _with_publish({"network": {"pod": {"publish": ["8080:80", port(9090)]}}}, ["53:53/udp"])
    assert got["network"]["pod"]["publish"] == [port(8080), port(9090), port(53, 53, "", "udp")]
    assert _with_publish({"vcpus": 1}, []) == {"vcpus": 1}
    with pytest.raises(UsageError):
        _with_publish({"network": {"none": None}}, ["80:80"])


# --- the spec --------------------------------------------------------------------------------


def test_a_spec_keeps_its_publishes_canonically() -> None:
    parsed = parse_spec(spec(port(8080), {"hostAddress": "2001:DB8::0:1", "hostPort": 443,
                                          "podPort": 8443}))
    assert parsed.network is not None
    assert parsed.network.publish == (PublishedPort("tcp", "", 8080, 80),
                                      PublishedPort("tcp", "2001:db8::1", 443, 8443))
    assert parse_spec(parsed.to_dict()) == parsed
    kept = parsed.to_dict()["network"]["pod"]["publish"]
    assert kept[1] == {"protocol": "tcp", "hostAddress": "2001:db8::1", "hostPort": 443,
                       "podPort": 8443}
    assert parse_spec(spec()).network.publish == ()  # type: ignore[union-attr]


@pytest.mark.parametrize(("item", "field"), [
    (port(0), "spec.network.publish[1].hostPort"),
    (port(65536), "spec.network.publish[1].hostPort"),
    (port(81, 0), "spec.network.publish[1].podPort"),
    (port(81, protocol="sctp"), "spec.network.publish[1].protocol"),
    (port(81, address="example.org"), "spec.network.publish[1].hostAddress"),
    (port(81, address="169.254.169.254"), "spec.network.publish[1].hostAddress"),
    (port(81, address="fe80::1"), "spec.network.publish[1].hostAddress"),
    (port(81, address="224.0.0.1"), "spec.network.publish[1].hostAddress"),
    (port(8080, address="127.0.0.1"), "spec.network.publish[1]"),  # overlaps every address
    (port(8080, 90), "spec.network.publish[1]"),
])
def test_bad_publishes_name_their_field(item: dict[str, Any], field: str) -> None:
    with pytest.raises(FeosError) as e:
        parse_spec(spec(port(8080), item))
    assert e.value.code == Code.INVALID_ARGUMENT
    assert e.value.message.startswith(field + ":"), e.value.message


def test_what_overlaps() -> None:
    any_ = PublishedPort("tcp", "", 80, 80)
    v4, v6 = PublishedPort("tcp", "0.0.0.0", 80, 80), PublishedPort("tcp", "::", 80, 80)
    lo4, lo6 = PublishedPort("tcp", "127.0.0.1", 80, 80), PublishedPort("tcp", "::1", 80, 80)
    assert overlaps(any_, lo4) and overlaps(any_, lo6) and overlaps(v4, lo4) and overlaps(v6, lo6)
    assert not overlaps(v4, v6) and not overlaps(v4, lo6) and not overlaps(lo4, lo6)
    assert not overlaps(any_, PublishedPort("udp", "", 80, 80))
    assert not overlaps(any_, PublishedPort("tcp", "", 81, 80))


# --- who holds a port ------------------------------------------------------------------------

TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1
   1: B80D0120000000000000000001000000:0050 00000000000000000000000000000000:0000 01 00000000:00000000 00:00000000 00000000     0        0 4243 1
"""
TCP4 = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 77 1
   1: 3500FEA9:0035 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 78 1
"""


def test_proc_net_tables_read_listening_sockets_only() -> None:
    assert _parse_proc(TCP6, "tcp", 6) == [
        Listener("tcp", ipaddress.ip_address("::1"), 8080, 4242)]
    assert _parse_proc(TCP4, "tcp", 4) == [
        Listener("tcp", ipaddress.ip_address("127.0.0.1"), 8081, 77),
        Listener("tcp", ipaddress.ip_address("169.254.0.53"), 53, 78)]


def test_the_holder_is_named() -> None:
    listeners = _parse_proc(TCP6, "tcp", 6) + _parse_proc(TCP4, "tcp", 4)
    assert holder_of_port(PublishedPort("tcp", "", 8080, 80), listeners, set()) == (
        "the node listens on [::1]:8080/tcp")
    assert holder_of_port(PublishedPort("tcp", "0.0.0.0", 8080, 80), listeners, set()) is None
    assert "feosd itself" in str(holder_of_port(PublishedPort("tcp", "", 8081, 80), listeners,
                                                {77}))
    # a link-local listener (the resolver) is never reached through a publish
    assert holder_of_port(PublishedPort("tcp", "", 53, 53), listeners, set()) is None
    assert holder_of_port(PublishedPort("udp", "", 8080, 80), listeners, set()) is None


def test_read_listeners_of_this_namespace(tmp_path: Path) -> None:
    fds = {name: os.open(f"/proc/net/{name}", os.O_RDONLY) for name in ("tcp", "tcp6")}
    try:
        found = read_listeners(fds)
    finally:
        for fd in fds.values():
            os.close(fd)
    assert all(li.protocol == "tcp" for li in found)


# --- check_spec ------------------------------------------------------------------------------


def podnet(pod_id: str, n: int, *published: PublishedPort) -> PodNet:
    return PodNet(pod_id, f"2001:db8:1::{n:x}", f"169.254.16.{n}", (), (), (), "", "qemu",
                  published=published)


class _View:
    def __init__(self, *pods: PodNet) -> None:
        self.pods = list(pods)

    def network_pods(self) -> list[PodNet]:
        return self.pods


class _Store:
    def get(self, key: str) -> None:
        return None

    def items(self) -> list[tuple[str, object]]:
        return []

    def __contains__(self, key: object) -> bool:
        return False


def network(tmp_path: Path, *pods: PodNet, proc: str = "") -> Network:
    net = Network(OPTIONS, tmp_path, _View(*pods), _Store(), _Store())
    net._reason = None  # as once run() set the network up
    net._node_addresses = (NODE4, NODE6)
    table = tmp_path / "tcp"
    table.write_text(proc or TCP4.splitlines()[0] + "\n")
    net._proc_net = {"tcp": os.open(table, os.O_RDONLY)}
    return net


def refused(net: Network, pod: PodNet) -> FeosError:
    with pytest.raises(FeosError) as e:
        net.check_spec(pod)
    return e.value


def test_another_pod_s_publish_is_already_exists_naming_it(tmp_path: Path) -> None:
    held = podnet("bcdefghjkmn", 3, PublishedPort("tcp", "192.0.2.1", 8080, 80))
    net = network(tmp_path, held)
    e = refused(net, podnet("abcdefghjkm", 2, PublishedPort("tcp", "", 8080, 8080)))
    assert e.code == Code.ALREADY_EXISTS
    assert e.message == ("spec.network.publish[0]: 8080:8080/tcp: pod bcdefghjkmn publishes "
                         "192.0.2.1:8080:80/tcp")
    net.check_spec(podnet("abcdefghjkm", 2, PublishedPort("tcp", "2001:db8:ffff::1", 8080, 80),
                          PublishedPort("udp", "", 8080, 80)))
    net.check_spec(held)  # its own publish is no conflict (a second create of the same pod)


def test_a_port_the_node_listens_on_is_already_exists(tmp_path: Path) -> None:
    net = network(tmp_path, proc=TCP4)
    e = refused(net, podnet("abcdefghjkm", 2, PublishedPort("tcp", "", 8081, 80)))
    assert e.code == Code.ALREADY_EXISTS and "the node listens on 127.0.0.1:8081/tcp" in e.message
    net.check_spec(podnet("abcdefghjkm", 2, PublishedPort("tcp", "192.0.2.1", 8081, 80)))


@pytest.mark.parametrize(("address", "code", "says"), [
    ("169.254.0.53", Code.INVALID_ARGUMENT, "the resolver's address"),
    ("169.254.169.254", Code.INVALID_ARGUMENT, "the metadata address"),
    ("169.254.169.1", Code.INVALID_ARGUMENT, "OTLP"),
    ("198.51.100.7", Code.FAILED_PRECONDITION, "not an address of this node"),
])
def test_feosd_s_own_addresses_and_strangers_are_refused(
    tmp_path: Path, address: str, code: Code, says: str
) -> None:
    e = refused(network(tmp_path), podnet("abcdefghjkm", 2, PublishedPort("tcp", address, 80, 80)))
    assert e.code == code and says in e.message, e.message
    assert e.message.startswith("spec.network.publish[0].hostAddress")
