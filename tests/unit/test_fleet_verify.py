"""The check of the control plane's chain (feos.fleet._verify), with certificates built here."""

from __future__ import annotations

import datetime
import ssl
import sys
from pathlib import Path

import pytest
import trio
from cryptography import x509

sys.path.insert(0, str(Path(__file__).parents[1]))
from controlplane_ca import DAY, NOW, TestCA, key_pem, make_ca_cert, make_leaf, pem, pin

from feos.fleet._verify import Refused, Verifier, client_context, peer_chain

URI = "spiffe://feos.local/ferun"


def verifier(ca: TestCA, **kw: object) -> Verifier:
    return Verifier(ca.server_name, ca.trust_domain, pin=kw.pop("pin", ca.pin), **kw)  # type: ignore[arg-type]


def refused(v: Verifier, chain: list[x509.Certificate]) -> str:
    with pytest.raises(Refused) as info:
        v.check(chain)
    return info.value.check


def test_a_root_with_a_uri_constraint_is_trusted_for_its_key() -> None:
    ca = TestCA()
    assert ca.root.extensions.get_extension_for_class(x509.NameConstraints)
    verifier(ca).check(ca.server_chain())


def test_the_bundle_trusts_the_same_chain_without_the_root_sent() -> None:
    ca = TestCA()
    Verifier(ca.server_name, ca.trust_domain, roots=[ca.root]).check([ca.server, ca.ca])
    assert refused(Verifier(ca.server_name, ca.trust_domain, roots=[TestCA().root]),
                   ca.server_chain()) == "root"


def test_an_intermediate_that_constrains_uris_is_refused() -> None:
    ca = TestCA(intermediate_constraints=x509.NameConstraints(
        permitted_subtrees=[x509.UniformResourceIdentifier("feos.local")], excluded_subtrees=None))
    assert refused(verifier(ca), ca.server_chain()) == "constraints"


def test_an_intermediates_dns_constraints_hold() -> None:
    within = TestCA(intermediate_constraints=x509.NameConstraints(
        permitted_subtrees=[x509.DNSName("test")], excluded_subtrees=None))
    verifier(within).check(within.server_chain())
    outside = TestCA(intermediate_constraints=x509.NameConstraints(
        permitted_subtrees=[x509.DNSName("example.org")], excluded_subtrees=None))
    assert refused(verifier(outside), outside.server_chain()) == "constraints"


def test_a_pin_of_a_certificate_other_than_the_root_is_refused() -> None:
    ca = TestCA()
    assert refused(verifier(ca, pin=pin(ca.ca)), ca.server_chain()) == "root"
    assert refused(verifier(ca, pin=pin(ca.server)), ca.server_chain()) == "root"
    assert refused(verifier(ca, pin=TestCA().pin), ca.server_chain()) == "root"


def test_the_pinned_root_must_be_sent_at_the_join() -> None:
    ca = TestCA()
    assert refused(verifier(ca), [ca.server, ca.ca]) == "root"


def test_a_wrong_name_is_refused() -> None:
    ca = TestCA(server_dns=["other.test"])
    assert refused(verifier(ca), ca.server_chain()) == "name"


@pytest.mark.parametrize("uris", [["spiffe://feos.local/other"], [URI, "spiffe://feos.local/x"],
                                  [], ["spiffe://other.domain/ferun"]])
def test_a_wrong_missing_or_extra_uri_is_refused(uris: list[str]) -> None:
    ca = TestCA(server_uris=uris)
    assert refused(verifier(ca), ca.server_chain()) == "uri"


def test_an_expired_certificate_is_refused() -> None:
    ca = TestCA(server_not_after=NOW - datetime.timedelta(hours=1))
    assert refused(verifier(ca), ca.server_chain()) == "validity"


def test_a_forged_signature_is_refused() -> None:
    ca = TestCA()
    other = TestCA()
    # the server's certificate as if issued by ca's issuer, but signed by another key
    forged = make_leaf(ca.ca, other.ca_key, ca.server_key.public_key(), dns=[ca.server_name],
                       uris=[URI], cn=ca.server_name)
    assert refused(verifier(ca), [forged, ca.ca, ca.root]) == "root"


def test_an_issuer_that_is_no_ca_is_refused() -> None:
    ca = TestCA()
    # a leaf certificate used as an issuer
    fake = make_leaf(ca.root, ca.root_key, ca.ca_key.public_key(), dns=[], uris=[],
                     cn="test issuer")
    server = make_leaf(fake, ca.ca_key, ca.server_key.public_key(), dns=[ca.server_name],
                       uris=[URI], cn=ca.server_name)
    assert refused(verifier(ca), [server, fake, ca.root]) == "ca"


def test_an_expired_root_is_refused() -> None:
    ca = TestCA()
    root = make_ca_cert("test root", ca.root_key, not_after=NOW - DAY)
    issuer = make_ca_cert("test issuer", ca.ca_key, issuer=root, issuer_key=ca.root_key)
    assert refused(verifier(ca), [ca.server, issuer, root]) == "validity"


def test_the_context_is_tls13_only_without_tickets() -> None:
    ctx = client_context("h2")
    assert ctx.minimum_version == ctx.maximum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.options & ssl.OP_NO_TICKET
    assert ctx.verify_mode == ssl.CERT_NONE


async def test_the_chain_is_read_from_a_trio_handshake(tmp_path: Path) -> None:
    """get_unverified_chain works through trio's SSLStream, with OpenSSL verifying nothing."""
    ca = TestCA()
    (tmp_path / "chain.pem").write_text(pem(*ca.server_chain()))
    (tmp_path / "key.pem").write_bytes(key_pem(ca.server_key))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "chain.pem", tmp_path / "key.pem")
    left, right = trio.testing.memory_stream_pair()
    client = trio.SSLStream(left, client_context("h2"), server_hostname="cp.test")
    server = trio.SSLStream(right, server_ctx, server_side=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.do_handshake)
        await client.do_handshake()
    chain = peer_chain(client._ssl_object)
    assert [c.subject for c in chain] == [c.subject for c in ca.server_chain()]
    verifier(ca)(client._ssl_object)
