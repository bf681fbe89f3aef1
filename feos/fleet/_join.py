"""The join: the token's secret, the node's name and a signing request, for a certificate.

The join dials --control-plane and checks its chain against the root the token pins before the
secret leaves (Verifier, with the pin). The answer's trust bundle must hold that root and its
certificate the node's own key. A join that fails is tried again with the same key; a token that
the control plane refuses (PERMISSION_DENIED) is not sent again until the token file holds
another: the same token written again is still the refused one (`TokenGate`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from .. import _schema
from ..errors import Code, FeosError
from ._h2client import decode, dial, encode, params_type, results_type
from ._identity import JoinToken, NodeDir, NodeInfo, read_token, spki_pin
from ._verify import Verifier, client_context

log = logging.getLogger(__name__)


def uplink() -> Any:
    return _schema.load("fleet").Uplink


class TokenGate:
    """The token file, read while the node has not joined, less a token that was refused."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.refused: str | None = None
        self._said = ""

    def read(self) -> tuple[str, JoinToken] | None:
        try:
            text = self.path.read_text().strip()
            if text == self.refused:
                self._say(f"{self.path}: the token was refused; waiting for another")
                return None
            return text, JoinToken.parse(text)
        except (OSError, FeosError) as exc:
            self._say(f"{self.path}: {exc.strerror if isinstance(exc, OSError) else exc}")
            return None

    def refuse(self, text: str) -> None:
        self.refused = text

    def refuse_current(self) -> None:
        """Whatever the file holds now is not sent again (a removed node needs a new token)."""
        try:
            self.refused = self.path.read_text().strip()
        except OSError:
            self.refused = None

    def _say(self, line: str) -> None:
        if line != self._said:  # once per change, not every poll
            log.warning("the join waits: %s", line)
            self._said = line


async def join(node: NodeDir, token: JoinToken, *, address: str, server_name: str,
               trust_domain: str, name: str) -> NodeInfo:
    """Join once; a FeosError says why not (PERMISSION_DENIED: the token was refused)."""
    csr = await trio.to_thread.run_sync(node.csr, name)
    verify = Verifier(server_name, trust_domain, pin=token.pin)
    client = await dial(address, client_context("h2"), verify, server_name)
    try:
        body = await client.call("/uplink/join", encode(params_type(uplink(), "join"),
                                                         {"secret": token.secret, "name": name,
                                                          "csr": csr}))
    finally:
        await client.aclose()
    answer = decode(results_type(uplink(), "join"), body)
    chain_pem, bundle_pem = str(answer.get("chain", "")), str(answer.get("bundle", ""))
    await trio.to_thread.run_sync(check_answer, node, token, chain_pem, bundle_pem)
    instances = tuple(str(i.get("address", "")) for i in answer.get("instances", []))
    return await trio.to_thread.run_sync(
        lambda: node.keep(name, chain_pem, int(answer.get("renewUnixNs", 0)),
                          bundle_pem=bundle_pem, instances=instances))


def check_answer(node: NodeDir, token: JoinToken, chain_pem: str, bundle_pem: str) -> None:
    try:
        bundle = x509.load_pem_x509_certificates(bundle_pem.encode())
        chain = x509.load_pem_x509_certificates(chain_pem.encode())
    except ValueError as exc:
        raise FeosError(Code.INTERNAL, f"the join's answer: {exc}") from None
    if not any(spki_pin(root) == token.pin for root in bundle):
        raise FeosError(Code.UNAUTHENTICATED,
                        "the join's trust bundle does not hold the root the token pins")
    ours = node.key().public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    theirs = chain[0].public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if ours != theirs:
        raise FeosError(Code.INTERNAL, "the join's certificate is not for the node's key")


__all__ = ["TokenGate", "join", "read_token"]
