"""TLS to the control plane: the contexts, the sockets' options, and the check of its chain.

Every connection to the control plane is TLS 1.3 without session resumption (no tickets, no
session handed to a new connection). The spec trusts a root for its key, without its name
constraints, and refuses an issuer below it that constrains URIs: OpenSSL applies every
certificate's constraints and Python 3.11's ssl hides the peer's chain, so the contexts verify
nothing in OpenSSL and `Verifier` checks the chain itself, with `cryptography`, after the handshake
and before any application byte (the join's secret above all) leaves the node. The chain is read
from the SSL object's private get_unverified_chain() (public from Python 3.13 on); without it no
connection is trusted.

The checks, each refusal naming the one that failed: the leaf names --control-plane-name (a DNS
name) and carries exactly one URI, spiffe://<trust domain>/ferun; every certificate is within its
validity; each is signed by the next; every issuer is a CA (basic constraints, its path length,
keyCertSign); the issuers' name constraints (DNS, IP) hold for the leaf, and an issuer that
constrains URIs is refused; the path ends at a trusted root: the self-signed certificate whose key
the join token pins, or one of the trust bundle's roots (matched by key). The root's own name
constraints are not applied.
"""

from __future__ import annotations

import _ssl  # the encoding get_unverified_chain's certificates take (private in 3.11)
import datetime
import logging
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

from ..errors import Code, FeosError
from ._identity import spki_pin

log = logging.getLogger(__name__)

USER_TIMEOUT_S = 20
MAX_DEPTH = 8


class Refused(FeosError):
    """The control plane's certificate failed a check; `check` names which."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(Code.UNAUTHENTICATED, f"the control plane's certificate: {message}")
        self.check = check


def client_context(alpn: str, *, cert: Path | None = None, key: Path | None = None
                   ) -> ssl.SSLContext:
    """A TLS 1.3 client context that verifies nothing itself (Verifier does) and resumes nothing."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.options |= ssl.OP_NO_TICKET
    ctx.set_alpn_protocols([alpn])
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def tune_socket(sock: Any) -> None:
    """Keepalive and a TCP_USER_TIMEOUT of 20 s: a dead peer is noticed within about 20 s."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_S * 1000)


def peer_chain(ssl_object: Any) -> list[x509.Certificate]:
    """The certificates the peer sent, its own first (trio's SSLStream: its `_ssl_object`)."""
    inner = getattr(ssl_object, "_sslobj", ssl_object)
    get = getattr(inner, "get_unverified_chain", None)
    if get is None:
        raise Refused("chain", "this Python's ssl does not give the peer's chain")
    certs = get() or []
    return [x509.load_der_x509_certificate(c.public_bytes(_ssl.ENCODING_DER)) for c in certs]


class Verifier:
    """The check of the control plane's chain, against a pin (the join) or the trust bundle."""

    def __init__(self, server_name: str, trust_domain: str, *, pin: str | None = None,
                 roots: Sequence[x509.Certificate] = ()) -> None:
        self.server_name = server_name.lower().rstrip(".")
        self.uri = f"spiffe://{trust_domain}/ferun"
        self.pin = pin
        self.root_keys = {spki_pin(r) for r in roots}
        self.roots = list(roots)

    def __call__(self, ssl_object: Any) -> None:
        """What NodeConnections and the uplink call after the handshake: raise to refuse."""
        try:
            self.check(peer_chain(ssl_object))
        except Refused as exc:
            log.warning("refused the control plane (%s check): %s", exc.check, exc.message)
            raise

    def check(self, chain: Sequence[x509.Certificate],
              now: datetime.datetime | None = None) -> None:
        if not chain:
            raise Refused("chain", "the server sent no certificate")
        now = now or datetime.datetime.now(datetime.UTC)
        leaf = chain[0]
        self._check_leaf(leaf)
        path = self._path(list(chain))
        for cert in path:
            _check_time(cert, now)
        for depth, issuer in enumerate(path[1:]):
            _check_issuer(issuer, depth)
        for issuer in path[1:-1]:  # the root is trusted for its key, not its constraints
            _check_constraints(issuer, leaf)

    def _check_leaf(self, leaf: x509.Certificate) -> None:
        try:
            sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            raise Refused("name", "it has no subject alternative names") from None
        names = [n.lower().rstrip(".") for n in sans.get_values_for_type(x509.DNSName)]
        if self.server_name not in names:
            raise Refused("name", f"it does not name {self.server_name} (it names "
                          f"{', '.join(names) or 'no DNS name'})")
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
        if uris != [self.uri]:
            raise Refused("uri", f"it must carry the one URI {self.uri}, not "
                          f"{', '.join(uris) or 'none'}")
        try:
            eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            return
        if ExtendedKeyUsageOID.SERVER_AUTH not in eku:
            raise Refused("usage", "it is not for TLS servers (extended key usage)")

    def _is_root(self, cert: x509.Certificate) -> bool:
        if not _self_signed(cert):
            return False
        key = spki_pin(cert)
        return key == self.pin if self.pin is not None else key in self.root_keys

    def _path(self, chain: list[x509.Certificate]) -> list[x509.Certificate]:
        """The leaf up to a trusted root, each certificate signed by the next."""
        candidates = chain[1:] + self.roots
        path = [chain[0]]
        while not self._is_root(path[-1]):
            if len(path) > MAX_DEPTH:
                raise Refused("chain", "its chain is longer than 8 certificates")
            issuer = _issuer_of(path[-1], candidates)
            if issuer is None:
                raise Refused("root", self._no_root(chain))
            path.append(issuer)
        return path

    def _no_root(self, chain: list[x509.Certificate]) -> str:
        if self.pin is not None and any(spki_pin(c) == self.pin for c in chain):
            return "the certificate the join token pins is in its chain but is not its root"
        if self.pin is not None:
            return "its chain does not hold the root the join token pins"
        return "its chain does not end at a root of the trust bundle"


def _self_signed(cert: x509.Certificate) -> bool:
    if cert.subject != cert.issuer:
        return False
    try:
        cert.verify_directly_issued_by(cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _issuer_of(cert: x509.Certificate, candidates: Sequence[x509.Certificate]
               ) -> x509.Certificate | None:
    for candidate in candidates:
        if candidate == cert or candidate.subject != cert.issuer:
            continue
        try:
            cert.verify_directly_issued_by(candidate)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return candidate
    return None


def _check_time(cert: x509.Certificate, now: datetime.datetime) -> None:
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise Refused("validity", f"{cert.subject.rfc4514_string()} is valid from "
                      f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S} to "
                      f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC, not now")


def _check_issuer(issuer: x509.Certificate, below: int) -> None:
    """An issuer is a CA whose path length allows the `below` CAs under it, and signs certs."""
    name = issuer.subject.rfc4514_string()
    try:
        basic = issuer.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        raise Refused("ca", f"the issuer {name} has no basic constraints") from None
    if not basic.ca:
        raise Refused("ca", f"the issuer {name} is not a CA")
    if basic.path_length is not None and below > basic.path_length:
        raise Refused("ca", f"the issuer {name} allows {basic.path_length} CAs below it")
    try:
        usage = issuer.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return
    if not usage.key_cert_sign:
        raise Refused("ca", f"the issuer {name} may not sign certificates (key usage)")


def _check_constraints(issuer: x509.Certificate, leaf: x509.Certificate) -> None:
    try:
        nc = issuer.extensions.get_extension_for_class(x509.NameConstraints).value
    except x509.ExtensionNotFound:
        return
    name = issuer.subject.rfc4514_string()
    subtrees = [*(nc.permitted_subtrees or []), *(nc.excluded_subtrees or [])]
    if any(isinstance(s, x509.UniformResourceIdentifier) for s in subtrees):
        raise Refused("constraints", f"the issuer {name} constrains URIs")
    unknown = [s for s in subtrees if not isinstance(s, x509.DNSName | x509.IPAddress)]
    if unknown:
        raise Refused("constraints", f"the issuer {name} has name constraints of a kind not "
                      f"checked here ({type(unknown[0]).__name__})")
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    for dns in sans.get_values_for_type(x509.DNSName):
        _constrain(name, dns, nc, x509.DNSName, _dns_within)
    for ip in sans.get_values_for_type(x509.IPAddress):
        _constrain(name, ip, nc, x509.IPAddress, lambda a, net: a in net)


def _constrain(issuer: str, value: Any, nc: x509.NameConstraints, kind: type,
               within: Any) -> None:
    permitted = [s.value for s in nc.permitted_subtrees or [] if isinstance(s, kind)]
    excluded = [s.value for s in nc.excluded_subtrees or [] if isinstance(s, kind)]
    if any(within(value, e) for e in excluded):
        raise Refused("constraints", f"the issuer {issuer} excludes {value}")
    if permitted and not any(within(value, p) for p in permitted):
        raise Refused("constraints", f"the issuer {issuer} does not permit {value}")


def _dns_within(name: str, tree: str) -> bool:
    name, tree = name.lower().rstrip("."), tree.lower().lstrip(".").rstrip(".")
    return not tree or name == tree or name.endswith("." + tree)

