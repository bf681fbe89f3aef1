"""The DHCPv6 codec of feos-host-init: a server's Reply as kea sends it decoded, the client's
messages as RFC 8415 lays them out, and mutated valid replies never raise anything but
FeosError."""

from __future__ import annotations

import ipaddress
import struct

from hypothesis import given
from hypothesis import strategies as st

from feos.errors import FeosError
from feos.hostinit import _dhcp6wire as w

CLIENT = w.duid_ll(bytes.fromhex("525400123456"))
SERVER = bytes.fromhex("0002000009bffeed0077")


def opt(code: int, data: bytes) -> bytes:
    return struct.pack("!HH", code, len(data)) + data


def reply(pd: bool = True) -> bytes:
    addr = opt(w.O_IAADDR, ipaddress.IPv6Address("2001:db8:77::100").packed + struct.pack("!II", 300, 600))
    ia_na = opt(w.O_IA_NA, struct.pack("!III", 1, 150, 200) + addr)
    if pd:
        pre = opt(w.O_IAPREFIX, struct.pack("!IIB", 300, 600, 56) + ipaddress.IPv6Address("2001:db8:7700::").packed)
        ia_pd = opt(w.O_IA_PD, struct.pack("!III", 1, 150, 200) + pre)
    else:
        ia_pd = opt(w.O_IA_PD, struct.pack("!III", 1, 0, 0) + opt(w.O_STATUS, struct.pack("!H", w.NO_PREFIX_AVAIL) + b"no prefixes"))
    ntp = opt(w.O_NTP, opt(w.NTP_SUB_ADDR, ipaddress.IPv6Address("2001:db8:77::123").packed)
              + opt(w.NTP_SUB_FQDN, b"\x04time\x07example\x00"))
    return (struct.pack("!I", (w.REPLY << 24) | 0xABCDEF) + opt(w.O_SERVERID, SERVER)
            + opt(w.O_CLIENTID, CLIENT) + ia_na + ia_pd
            + opt(w.O_DNS, ipaddress.IPv6Address("2001:db8:77::1").packed) + ntp
            + opt(w.O_SNTP, ipaddress.IPv6Address("2001:db8:77::124").packed) + opt(999, b"x"))


def test_reply_decoded() -> None:
    m = w.decode(reply())
    assert (m.kind, m.xid, m.client_id, m.server_id) == (w.REPLY, 0xABCDEF, CLIENT, SERVER)
    assert m.ia_na is not None and m.ia_na.addresses == (
        w.Address(ipaddress.IPv6Address("2001:db8:77::100"), 300, 600),)
    assert (m.ia_na.t1, m.ia_na.t2) == (150, 200)
    assert m.ia_pd is not None and m.ia_pd.prefixes == (
        w.Prefix(ipaddress.IPv6Network("2001:db8:7700::/56"), 300, 600),)
    assert m.dns == (ipaddress.IPv6Address("2001:db8:77::1"),)
    assert m.ntp == (ipaddress.IPv6Address("2001:db8:77::123"), "time.example",
                     ipaddress.IPv6Address("2001:db8:77::124"))


def test_reply_without_prefix_delegation() -> None:
    m = w.decode(reply(pd=False))
    assert m.ia_pd is not None and m.ia_pd.prefixes == ()
    assert (m.ia_pd.status, m.ia_pd.message) == (w.NO_PREFIX_AVAIL, "no prefixes")


def test_request_laid_out_as_rfc8415() -> None:
    m = w.decode(reply())
    data = w.encode(w.REQUEST, 0x123456, CLIENT, server_id=SERVER, ia_na=m.ia_na, ia_pd=m.ia_pd,
                    elapsed_cs=7)
    assert data[:4] == bytes([w.REQUEST, 0x12, 0x34, 0x56])
    opts = w._options(data[4:])
    codes = [c for c, _ in opts]
    assert codes == [w.O_CLIENTID, w.O_SERVERID, w.O_ORO, w.O_ELAPSED, w.O_IA_NA, w.O_IA_PD]
    body = dict(opts)
    assert body[w.O_CLIENTID] == CLIENT and body[w.O_ELAPSED] == b"\x00\x07"
    ia_na = w._ia(body[w.O_IA_NA], pd=False)
    assert [a.address for a in ia_na.addresses] == [ipaddress.IPv6Address("2001:db8:77::100")]
    ia_pd = w._ia(body[w.O_IA_PD], pd=True)
    assert [p.prefix for p in ia_pd.prefixes] == [ipaddress.IPv6Network("2001:db8:7700::/56")]


def test_solicit_asks_for_both_ias() -> None:
    data = w.encode(w.SOLICIT, 1, CLIENT, ia_na=w.IA(0, 0), ia_pd=w.IA(0, 0))
    codes = [c for c, _ in w._options(data[4:])]
    assert w.O_SERVERID not in codes and w.O_IA_NA in codes and w.O_IA_PD in codes


@given(st.data())
def test_mutated_replies_raise_only_feos_errors(data: st.DataObject) -> None:
    raw = bytearray(reply(pd=data.draw(st.booleans())))
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        w.decode(bytes(raw[:cut]))
    except FeosError:
        pass
