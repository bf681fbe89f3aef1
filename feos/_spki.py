"""The pin of a certificate's key: what a join token names, and what feosctl --tls-pin checks.

Apart from feos.fleet so that feosctl, which checks a pin, does not import the control plane's link.
"""

from __future__ import annotations

import base64
import hashlib

from cryptography import x509
from cryptography.hazmat.primitives import serialization


def spki_pin(cert: x509.Certificate) -> str:
    """Unpadded base64url of the SHA-256 over the certificate's SubjectPublicKeyInfo (DER)."""
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.urlsafe_b64encode(hashlib.sha256(spki).digest()).rstrip(b"=").decode()
