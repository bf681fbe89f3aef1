"""TLS for the API on TCP: feosd's contexts (followed as their files change), feosctl's context.

feosd (`ServerTls`, `ServerContexts`): TLS 1.3 only, and a client certificate required, trusted
when it chains to the operator's CA (--tcp-client-ca) or, while the node is joined, to a root of
the control plane's trust bundle (<node-dir>/bundle.pem). Its own certificate is --tcp-cert and
--tcp-key, else one feosd makes once and keeps in <state-dir>/tls/ (`own_certificate`), which a
client checks by the pin of its key (feosd logs it at the start).

The files are followed, not read once: every handshake stats them (in the SNI callback, which
OpenSSL calls for every ClientHello, with a server name or without) and a change builds a new
context, which that handshake and the later ones switch to. A join, a removed node, a renewed or
replaced file take effect at the next connection, without a restart; the connections made before
keep what they were admitted with. A changed file that is unreadable or bad keeps the previous
context, logged once per change.

Refusals: OpenSSL refuses a client without a certificate, with one no trusted CA issued, or with
an expired one in the handshake, before a byte of Cap'n Proto is read; `_Refusals` refuses a
node's certificate there too (`node_identity`), and logs each at INFO (anyone who reaches the
port can knock). asyncio then drops the connection without sending
the alert, so feosctl tells a refusal from a lost connection by the session ticket, which a TLS 1.3
server sends once it has accepted the client (`ClientContext.refused`).

feosctl (`ClientTls`): its certificate and key, and feosd's certificate checked against a CA file
(for the server's name, or --tls-server-name), or by the pin of its key instead (--tls-pin).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from ..errors import Code, FeosError

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
OWN_KEY, OWN_CERT = "key.pem", "cert.pem"
_OWN_DAYS = 3650
_Stamp = tuple[tuple[int, int, int] | None, ...]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- feosd ---------------------------------------------------------------------------------------


@attrs.frozen
class ServerTls:
    """What the TCP listener's TLS is made of; each path named by the option that gave it."""

    client_ca: Path
    cert: Path
    key: Path
    bundle: Path  # trusted while it exists (the node is joined)
    cert_option: str = "--tcp-cert"
    key_option: str = "--tcp-key"


def _invalid(option: str, path: Path, exc: Exception) -> FeosError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if isinstance(exc, ssl.SSLError) and exc.reason:
        reason = exc.reason.replace("_", " ").lower()
    return FeosError(Code.INVALID_ARGUMENT, f"{option} {path}: {reason}")


def server_context(tls: ServerTls) -> ssl.SSLContext:
    """The context of `tls`'s files as they are now; a FeosError names the file that is bad."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
    except (OSError, ValueError) as exc:
        for option, path in ((tls.cert_option, tls.cert), (tls.key_option, tls.key)):
            if not path.is_file():
                raise _invalid(option, path, exc) from None
        raise _invalid(f"{tls.cert_option}/{tls.key_option}", tls.cert, exc) from None
    try:
        ctx.load_verify_locations(cafile=tls.client_ca)
    except (OSError, ValueError) as exc:
        raise _invalid("--tcp-client-ca", tls.client_ca, exc) from None
    if tls.bundle.exists():
        try:
            ctx.load_verify_locations(cafile=tls.bundle)
        except (OSError, ValueError) as exc:
            raise _invalid("the control plane's trust bundle", tls.bundle, exc) from None
    return ctx


class _Refusals(ssl.SSLObject):
    """A server's SSL object: it refuses a node's certificate, and logs what it refuses."""

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
            node = node_identity(self.getpeercert() or {})
            if node is not None:
                raise ssl.SSLError(f"a node's certificate ({node}): nodes do not call each "
                                   "other's API")
        except ssl.SSLWantReadError:
            raise
        except ssl.SSLError as exc:
            log.info("the API on TCP refused a client in the TLS handshake: %s", refusal(exc))
            raise


def node_identity(peercert: dict[str, Any]) -> str | None:
    """The SPIFFE ID of a node (spiffe://<trust domain>/node/<name>) the certificate carries.

    The control plane's CA issues the nodes' certificates too, for client authentication: with
    its bundle trusted, any node could call every other's API as root. Refused after OpenSSL's
    check and before the handshake is done for asyncio, so no session ticket leaves and no byte
    of Cap'n Proto is read."""
    for kind, value in peercert.get("subjectAltName", ()):
        if kind == "URI" and value.startswith("spiffe://") and "/node/" in value:
            return str(value)
    return None


def refusal(exc: ssl.SSLError) -> str:
    """A handshake's failure in words: OpenSSL's verify message, else its reason."""
    message = getattr(exc, "verify_message", None)  # OpenSSL's; not on a check of our own
    if message:
        return str(message)
    reason = getattr(exc, "reason", None)
    if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
        return "no client certificate"
    if reason:
        return str(reason).replace("_", " ").lower()
    return exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)


class ServerContexts:
    """The listener's context, switching each handshake to the context of the files as they are.

    Built on feosd's start, where a bad file refuses the start; followed on the Cap'n Proto
    thread, the only one that runs the SNI callback."""

    def __init__(self, tls: ServerTls) -> None:
        self._tls = tls
        self._stamp = self._files()
        self._current = server_context(tls)
        self.listening = server_context(tls)
        self.listening.sni_callback = self._switch
        self.listening.sslobject_class = _Refusals

    def _files(self) -> _Stamp:
        stamps: list[tuple[int, int, int] | None] = []
        for path in (self._tls.client_ca, self._tls.cert, self._tls.key, self._tls.bundle):
            try:
                st = os.stat(path)
            except OSError:
                stamps.append(None)
            else:
                stamps.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(stamps)

    def current(self) -> ssl.SSLContext:
        stamp = self._files()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._current = server_context(self._tls)
            except FeosError as exc:
                log.warning("the API's TLS files changed, and %s: the previous ones stay",
                            exc.message)
            else:
                log.info("the API's TLS files changed: new connections use them (%s)",
                         "the control plane's bundle trusted" if self._tls.bundle.exists()
                         else "no control plane's bundle")
        return self._current

    def _switch(self, sslobj: Any, _server_name: str | None, _ctx: ssl.SSLContext) -> None:
        try:
            sslobj.context = self.current()
        except Exception:  # never an exception into OpenSSL's callback: the handshake goes on
            log.exception("the API's TLS context could not be switched")


def own_certificate(directory: Path) -> tuple[Path, Path]:
    """feosd's own certificate and key in `directory` (0700), made the first time and kept.

    Self-signed, ECDSA P-256, naming the host's name, localhost, 127.0.0.1 and ::1; a client
    checks it by the pin of its key (feosctl --tls-pin), as an address a node gets later is not
    in it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from ..records import write_whole

    cert_path, key_path = directory / OWN_CERT, directory / OWN_KEY
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    host = socket.gethostname()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"feosd {host}")])
    now = datetime.datetime.now(datetime.UTC)
    sans = [x509.DNSName(host), x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1"))]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=_OWN_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
            .add_extension(x509.SubjectAlternativeName(sans), False)
            .sign(key, hashes.SHA256()))
    write_whole(key_path, key.private_bytes(serialization.Encoding.PEM,
                                            serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    write_whole(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def pin_of(cert_path: Path) -> str:
    from cryptography import x509

    from .._spki import spki_pin

    return spki_pin(x509.load_pem_x509_certificate(cert_path.read_bytes()))


# -- feosctl -------------------------------------------------------------------------------------


class _Checked(ssl.SSLObject):
    """A client's SSL object: known to its context (for `refused`), and checking --tls-pin."""

    def do_handshake(self) -> None:
        super().do_handshake()
        ctx = self.context
        if not isinstance(ctx, ClientContext):
            return
        ctx.sslobj = self
        if ctx.pin is not None:
            from cryptography import x509

            from .._spki import spki_pin

            der = self.getpeercert(binary_form=True)
            got = spki_pin(x509.load_der_x509_certificate(der)) if der else "none"
            if got != ctx.pin:
                raise ssl.SSLCertVerificationError(
                    f"feosd's key has the pin {got}, not the --tls-pin {ctx.pin}")


class ClientContext(ssl.SSLContext):
    """A client's context, which knows its connection's SSL object once the handshake is done."""

    pin: str | None = None
    sslobj: ssl.SSLObject | None = None

    def refused(self) -> bool:
        """Whether feosd refused this client in the handshake: TLS 1.3 has the client's side end
        before the server checks the client's certificate, and a server that accepts it sends a
        session ticket at once; a connection that ends without one was refused."""
        if self.sslobj is None:
            return False
        session = self.sslobj.session
        return session is None or not session.has_ticket


@attrs.frozen
class ClientTls:
    """feosctl's TLS: its certificate and key, and how feosd's certificate is checked."""

    cert: Path
    key: Path | None = None  # None: in the certificate's file
    ca: Path | None = None  # None: the system's CAs, unless pinned
    pin: str | None = None
    server_name: str | None = None

    def context(self) -> ClientContext:
        ctx = ClientContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.sslobject_class = _Checked
        _load(lambda: ctx.load_cert_chain(self.cert, self.key), "--tls-cert/--tls-key", self.cert)
        if self.pin is not None:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            ctx.pin = self.pin
        elif self.ca is not None:
            ca = self.ca
            _load(lambda: ctx.load_verify_locations(cafile=ca), "--tls-ca", ca)
        else:
            ctx.load_default_certs()
        return ctx


def _load(load: Callable[[], None], option: str, path: Path) -> None:
    try:
        load()
    except (OSError, ValueError) as exc:
        raise _invalid(option, path, exc) from None
