"""The node's identity for the control plane: its key, its certificate, the trust bundle, node.json.

The node's directory (--node-dir, <state-dir>/node by default, mode 0700) holds key.pem (the
ECDSA P-256 key, PKCS#8, 0600, made once and kept across renewals and failed joins), chain.pem
(the node's certificate, then its issuer), bundle.pem (the platform CA's roots) and node.json (the
name, the SPIFFE ID, the certificate's end and renewal time, the instances listed last). Each file
is written whole (a temporary file, fsync, rename). A removed node's files move into
removed-<time>/ beside them, the key with them: the next join makes a new key.

The join token is `feos-join-<secret>.<pin>`: the pin is the unpadded base64url of the SHA-256 of
the control plane's root's SubjectPublicKeyInfo (DER), so the secret is everything between the
prefix and the last dot.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .._spki import spki_pin as spki_pin
from ..errors import Code, FeosError
from ..records import fsync_dir, write_whole

TOKEN_PREFIX = "feos-join-"
KEY, CHAIN, BUNDLE, NODE = "key.pem", "chain.pem", "bundle.pem", "node.json"


@attrs.frozen
class JoinToken:
    secret: str
    pin: str

    @classmethod
    def parse(cls, text: str) -> JoinToken:
        text = text.strip()
        if not text.startswith(TOKEN_PREFIX) or "." not in text:
            raise FeosError(Code.INVALID_ARGUMENT,
                            f"the join token must read {TOKEN_PREFIX}<secret>.<pin>")
        secret, _, pin = text[len(TOKEN_PREFIX):].rpartition(".")
        if not secret or len(pin) != 43:
            raise FeosError(Code.INVALID_ARGUMENT, "the join token's secret is empty or its pin "
                            "is not a base64url SHA-256 (43 characters)")
        return cls(secret, pin)


def read_token(path: Path) -> JoinToken:
    try:
        text = path.read_text()
    except OSError as exc:
        raise FeosError(Code.FAILED_PRECONDITION,
                        f"the join token file {path}: {exc.strerror or exc}") from None
    return JoinToken.parse(text)


@attrs.frozen
class NodeInfo:
    """node.json."""

    name: str
    spiffe_id: str
    not_after_unix_ns: int
    renew_unix_ns: int
    instances: tuple[str, ...] = ()  # HOST:PORT each

    def to_json(self) -> bytes:
        return json.dumps({
            "name": self.name, "spiffeId": self.spiffe_id,
            "notAfterUnixNs": self.not_after_unix_ns, "renewUnixNs": self.renew_unix_ns,
            "instances": list(self.instances),
        }, indent=2).encode()

    @classmethod
    def from_json(cls, data: bytes) -> NodeInfo:
        d: dict[str, Any] = json.loads(data)
        return cls(str(d["name"]), str(d["spiffeId"]), int(d["notAfterUnixNs"]),
                   int(d["renewUnixNs"]),
                   tuple(str(i) for i in d.get("instances", [])))


def spiffe_id(cert: x509.Certificate) -> str:
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ""
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    return uris[0] if len(uris) == 1 else ""


def renewal_time(cert: x509.Certificate, renew_unix_ns: int) -> int:
    """When to renew: what the control plane said, else two thirds into the validity."""
    if renew_unix_ns > 0:
        return renew_unix_ns
    start = cert.not_valid_before_utc.timestamp()
    end = cert.not_valid_after_utc.timestamp()
    return int((start + (end - start) * 2 / 3) * 1e9)


class NodeDir:
    """The node's directory and what it holds; every method does blocking file I/O."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def prepare(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)

    def key(self) -> ec.EllipticCurvePrivateKey:
        """The node's key, made the first time and kept (a retried join uses the same one)."""
        self.prepare()
        path = self.path / KEY
        try:
            loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except FileNotFoundError:
            key = ec.generate_private_key(ec.SECP256R1())
            write_whole(path, key.private_bytes(serialization.Encoding.PEM,
                                                serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
            return key
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise FeosError(Code.FAILED_PRECONDITION, f"{path} is not an ECDSA key")
        return loaded

    def csr(self, name: str) -> bytes:
        request = (x509.CertificateSigningRequestBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .sign(self.key(), hashes.SHA256()))
        return request.public_bytes(serialization.Encoding.DER)

    def joined(self) -> bool:
        return all((self.path / f).exists() for f in (KEY, CHAIN, BUNDLE, NODE))

    def info(self) -> NodeInfo | None:
        try:
            return NodeInfo.from_json((self.path / NODE).read_bytes())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def chain(self) -> list[x509.Certificate]:
        return x509.load_pem_x509_certificates((self.path / CHAIN).read_bytes())

    def bundle(self) -> list[x509.Certificate]:
        return x509.load_pem_x509_certificates((self.path / BUNDLE).read_bytes())

    def keep(self, name: str, chain_pem: str, renew_unix_ns: int, *, bundle_pem: str | None = None,
             instances: tuple[str, ...] | None = None) -> NodeInfo:
        """Keep a chain (a join's or a renewal's) and what comes with it, each file whole."""
        chain = x509.load_pem_x509_certificates(chain_pem.encode())
        if instances is None:
            old = self.info()
            instances = old.instances if old is not None else ()
        leaf = chain[0]
        info = NodeInfo(name, spiffe_id(leaf), int(leaf.not_valid_after_utc.timestamp() * 1e9),
                        renewal_time(leaf, renew_unix_ns), instances)
        if bundle_pem is not None:
            write_whole(self.path / BUNDLE, bundle_pem.encode())
        write_whole(self.path / CHAIN, chain_pem.encode())
        write_whole(self.path / NODE, info.to_json())
        return info

    def keep_instances(self, instances: tuple[str, ...]) -> None:
        info = self.info()
        if info is not None and info.instances != instances:
            write_whole(self.path / NODE, attrs.evolve(info, instances=instances).to_json())

    def remove(self) -> Path:
        """A removed node: its files into removed-<time>/, so that the next join starts anew."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.path / f"removed-{stamp}"
        n = 1
        while target.exists():
            n += 1
            target = self.path / f"removed-{stamp}-{n}"
        target.mkdir(mode=0o700)
        for name in (KEY, CHAIN, BUNDLE, NODE):
            if (self.path / name).exists():
                os.rename(self.path / name, target / name)
        fsync_dir(target)
        fsync_dir(self.path)
        return target
