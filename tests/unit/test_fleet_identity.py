"""The node's identity on disk and the join token (feos.fleet._identity)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from controlplane_ca import TestCA

from feos.errors import Code, FeosError
from feos.fleet._identity import JoinToken, NodeDir, spki_pin


def test_the_token_splits_at_its_last_dot() -> None:
    pin = TestCA().pin
    token = JoinToken.parse(f"feos-join-s3cr.et.{pin}\n")
    assert token == JoinToken("s3cr.et", pin)


@pytest.mark.parametrize("text", ["", "feos-join-", "join-abc.def", "feos-join-.x" + "A" * 42,
                                  "feos-join-secret.short"])
def test_a_malformed_token_is_invalid(text: str) -> None:
    with pytest.raises(FeosError) as info:
        JoinToken.parse(text)
    assert info.value.code == Code.INVALID_ARGUMENT


def test_the_pin_is_base64url_sha256_of_the_spki() -> None:
    ca = TestCA()
    assert len(spki_pin(ca.root)) == 43 and "=" not in spki_pin(ca.root)
    assert spki_pin(ca.root) == ca.pin != spki_pin(ca.ca)


def test_the_key_is_made_once_and_kept_private(tmp_path: Path) -> None:
    node = NodeDir(tmp_path / "node")
    first = node.key()
    assert node.key().private_numbers() == first.private_numbers()
    assert stat.S_IMODE((tmp_path / "node").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "node" / "key.pem").stat().st_mode) == 0o600
    assert b"BEGIN PRIVATE KEY" in (tmp_path / "node" / "key.pem").read_bytes()  # PKCS#8


def test_a_kept_chain_names_the_node_and_its_renewal(tmp_path: Path) -> None:
    ca = TestCA()
    node = NodeDir(tmp_path / "node")
    chain = ca.issue_node(node.csr("n1"), "n1")
    info = node.keep("n1", chain, 0, bundle_pem=ca.bundle_pem(), instances=("a:1",))
    assert node.joined() and node.info() == info
    assert info.spiffe_id == "spiffe://feos.local/node/n1"
    assert 0 < info.renew_unix_ns < info.not_after_unix_ns
    assert node.bundle()[0] == ca.root
    renewed = node.keep("n1", ca.issue_node(node.csr("n1"), "n1"), 123)
    assert renewed.renew_unix_ns == 123 and renewed.instances == ("a:1",)


def test_a_removed_node_moves_aside_with_its_key(tmp_path: Path) -> None:
    ca = TestCA()
    node = NodeDir(tmp_path / "node")
    key = node.key()
    node.keep("n1", ca.issue_node(node.csr("n1"), "n1"), 0, bundle_pem=ca.bundle_pem())
    moved = node.remove()
    assert moved.name.startswith("removed-") and (moved / "key.pem").exists()
    assert not node.joined()
    assert node.key().private_numbers() != key.private_numbers()


def test_a_join_answer_must_hold_the_pinned_root_and_the_nodes_key(tmp_path: Path) -> None:
    from feos.fleet._join import check_answer

    ca = TestCA()
    node = NodeDir(tmp_path / "node")
    chain = ca.issue_node(node.csr("n1"), "n1")
    token = JoinToken("s", ca.pin)
    check_answer(node, token, chain, ca.bundle_pem())
    with pytest.raises(FeosError) as info:
        check_answer(node, token, chain, TestCA().bundle_pem())
    assert info.value.code == Code.UNAUTHENTICATED and "pins" in info.value.message
    other = NodeDir(tmp_path / "other")
    with pytest.raises(FeosError) as info:
        check_answer(node, token, ca.issue_node(other.csr("n1"), "n1"), ca.bundle_pem())
    assert "node's key" in info.value.message
