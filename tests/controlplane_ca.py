"""The test control plane's CA: a root, an intermediate, the server's certificate, nodes' ones.

Built with `cryptography` as ferund init-ca builds its own: the root may carry a URI name
constraint (the roots of old did), which the node must not apply; the intermediate issues the
server's certificate (DNS name, the one URI spiffe://<trust domain>/ferun) and the nodes' (their
SPIFFE ID spiffe://<trust domain>/node/<name>). Every knob a test of the check needs is a keyword.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NOW = datetime.datetime.now(datetime.UTC)
DAY = datetime.timedelta(days=1)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def pem(*certs: x509.Certificate) -> str:
    return "".join(c.public_bytes(serialization.Encoding.PEM).decode() for c in certs)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def pin(cert: x509.Certificate) -> str:
    spki = cert.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.urlsafe_b64encode(hashlib.sha256(spki).digest()).rstrip(b"=").decode()


def make_ca_cert(cn: str, key: ec.EllipticCurvePrivateKey, *, issuer: x509.Certificate | None = None,
                 issuer_key: ec.EllipticCurvePrivateKey | None = None,
                 constraints: x509.NameConstraints | None = None, path_length: int | None = None,
                 not_after: datetime.datetime | None = None) -> x509.Certificate:
    builder = (x509.CertificateBuilder().subject_name(_name(cn))
               .issuer_name(issuer.subject if issuer else _name(cn))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(NOW - DAY).not_valid_after(not_after or NOW + 3650 * DAY)
               .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), True)
               .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                            False), True))
    if constraints is not None:
        builder = builder.add_extension(constraints, True)
    return builder.sign(issuer_key or key, hashes.SHA256())


def make_leaf(issuer: x509.Certificate, issuer_key: ec.EllipticCurvePrivateKey,
              public_key: Any, *, dns: list[str], uris: list[str], server: bool = True,
              not_before: datetime.datetime | None = None,
              not_after: datetime.datetime | None = None, cn: str = "leaf") -> x509.Certificate:
    names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    names += [x509.UniformResourceIdentifier(u) for u in uris]
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(issuer.subject)
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(not_before or NOW - DAY)
               .not_valid_after(not_after or NOW + 30 * DAY)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
               .add_extension(x509.ExtendedKeyUsage([usage]), False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), False)
    return builder.sign(issuer_key, hashes.SHA256())


def uri_constraint(trust_domain: str) -> x509.NameConstraints:
    return x509.NameConstraints(permitted_subtrees=[x509.UniformResourceIdentifier(trust_domain)],
                                excluded_subtrees=None)


class TestCA:
    """A root (URI-constrained by default), an intermediate, the server's certificate."""

    __test__ = False

    def __init__(self, server_name: str = "cp.test", trust_domain: str = "feos.local", *,
                 root_constraint: bool = True,
                 intermediate_constraints: x509.NameConstraints | None = None,
                 server_dns: list[str] | None = None, server_uris: list[str] | None = None,
                 server_not_after: datetime.datetime | None = None) -> None:
        self.trust_domain = trust_domain
        self.server_name = server_name
        self.root_key = ec.generate_private_key(ec.SECP256R1())
        self.root = make_ca_cert("test root", self.root_key,
                                 constraints=uri_constraint(trust_domain) if root_constraint else None)
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        self.ca = make_ca_cert("test issuer", self.ca_key, issuer=self.root,
                               issuer_key=self.root_key, constraints=intermediate_constraints,
                               path_length=0)
        self.server_key = ec.generate_private_key(ec.SECP256R1())
        self.server = make_leaf(
            self.ca, self.ca_key, self.server_key.public_key(),
            dns=server_dns if server_dns is not None else [server_name],
            uris=server_uris if server_uris is not None else [f"spiffe://{trust_domain}/ferun"],
            not_after=server_not_after, cn=server_name)

    @property
    def pin(self) -> str:
        return pin(self.root)

    def server_chain(self) -> list[x509.Certificate]:
        return [self.server, self.ca, self.root]

    def bundle_pem(self) -> str:
        return pem(self.root)

    def issue_node(self, csr_der: bytes, name: str, lifetime: datetime.timedelta = 30 * DAY
                   ) -> str:
        """A node's chain (PEM: its certificate, then the issuer) for its signing request."""
        csr = x509.load_der_x509_csr(csr_der)
        if not csr.is_signature_valid:
            raise ValueError("the signing request's signature is wrong")
        now = datetime.datetime.now(datetime.UTC)
        leaf = make_leaf(self.ca, self.ca_key, csr.public_key(), dns=[],
                         uris=[f"spiffe://{self.trust_domain}/node/{name}"], server=False,
                         not_before=now - datetime.timedelta(minutes=1), not_after=now + lifetime,
                         cn=name)
        return pem(leaf, self.ca)
