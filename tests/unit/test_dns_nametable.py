"""Name tables: validation, deltas from the node's version only, and the lookup order."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.net._nametable import (
    NameTable,
    NameTableDelta,
    apply_delta,
    is_label,
    lookup_name,
)

V6, V4 = ipaddress.IPv6Address, ipaddress.IPv4Address


def table(tid: str, names: dict[str, list[str]], includes: tuple[str, ...] = ()) -> NameTable:
    return NameTable.parse(tid, 1, names, includes)


@pytest.mark.parametrize(
    ("tid", "names", "includes", "field"),
    [
        ("Web", {}, (), "id"),
        ("-web", {}, (), "id"),
        ("a" * 64, {}, (), "id"),
        ("web", {"DB": ["::1"]}, (), "names[DB]"),
        ("web", {"db.x": ["::1"]}, (), "names[db.x]"),
        ("web", {"db-": ["::1"]}, (), "names[db-]"),
        ("web", {"db": []}, (), "names[db]"),
        ("web", {"db": ["300.1.1.1"]}, (), "names[db].addresses[0]"),
        ("web", {"db": ["::1", "fe80::1%eth0"]}, (), "names[db].addresses[1]"),
        ("web", {"db": "::1"}, (), "names[db]"),
        ("web", {}, ("web",), "includes[0]"),
        ("web", {}, ("a", "a"), "includes[1]"),
        ("web", {}, ("A",), "includes[0]"),
    ],
)
def test_invalid_tables_name_the_field(tid: str, names: dict, includes: tuple, field: str) -> None:
    with pytest.raises(FeosError) as e:
        NameTable.parse(tid, 1, names, includes)
    assert e.value.code == Code.INVALID_ARGUMENT
    assert e.value.message.startswith(f"{field}: ")


def test_a_uuid_and_a_short_id_are_ids_and_addresses_are_parsed() -> None:
    t = NameTable.parse(
        "22222222-3333-4444-5555-666666666666", 0, {"db": ["2001:db8::1", "10.0.0.1"]}
    )
    assert t.names["db"] == (V6("2001:db8::1"), V4("10.0.0.1"))
    assert NameTable.parse("a1b2c3d4e5f", 2**64 - 1, {}).version == 2**64 - 1
    with pytest.raises(FeosError):
        NameTable.parse("web", 2**64, {})
    with pytest.raises(FeosError):
        NameTable.parse("web", -1, {})


def test_a_delta_applies_only_to_the_version_the_node_has() -> None:
    t = NameTable.parse("web", 4, {"db": ["::1"], "cache": ["10.0.0.2"]}, ("common",))
    after = apply_delta(t, NameTableDelta("web", 4, 2, {"api": ["::2"], "db": ["::3"]}, ("cache",)))
    assert after == NameTable.parse("web", 2, {"db": ["::3"], "api": ["::2"]}, ("common",))
    with pytest.raises(FeosError) as e:
        apply_delta(t, NameTableDelta("web", 3, 5))
    assert e.value.code == Code.FAILED_PRECONDITION
    assert "3" in e.value.message
    assert "4" in e.value.message
    with pytest.raises(FeosError) as e:
        apply_delta(t, NameTableDelta("web", 4, 5, {"db": ["::1"]}, ("db",)))
    assert e.value.code == Code.INVALID_ARGUMENT
    with pytest.raises(FeosError):
        apply_delta(t, NameTableDelta("web", 4, 5, {"BAD": ["::1"]}))


def test_first_table_wins_even_without_the_family_asked() -> None:
    tables = {"a": table("a", {"db": ["10.0.0.1"]}), "b": table("b", {"db": ["::2"]})}
    assert lookup_name("db", ["a", "b"], tables) == (V4("10.0.0.1"),)
    assert lookup_name("db", ["b", "a"], tables) == (V6("::2"),)


def test_own_names_before_includes_in_their_order_and_not_further() -> None:
    tables = {
        "pod": table("pod", {"own": ["::1"]}, ("inc1", "inc2")),
        "inc1": table("inc1", {"own": ["::99"], "x": ["::11"]}, ("deep",)),
        "inc2": table("inc2", {"x": ["::22"], "y": ["::23"]}),
        "deep": table("deep", {"z": ["::33"]}),
        "later": table("later", {"z": ["::44"], "x": ["::55"]}),
    }
    pod = ["pod", "later"]
    assert lookup_name("own", pod, tables) == (V6("::1"),)
    assert lookup_name("x", pod, tables) == (V6("::11"),)
    assert lookup_name("y", pod, tables) == (V6("::23"),)
    # deep is included by an included table: not followed, so the next pod table answers.
    assert lookup_name("z", pod, tables) == (V6("::44"),)


def test_missing_tables_hold_nothing_and_matching_is_one_label_any_case() -> None:
    tables = {"b": table("b", {"db": ["::2"]}, ("gone",))}
    assert lookup_name("db", ["gone", "b"], tables) == (V6("::2"),)
    assert lookup_name("DB", ["b"], tables) == (V6("::2"),)
    assert lookup_name("dB", ["b"], tables) == (V6("::2"),)
    assert lookup_name("db.svc", ["b"], tables) is None
    assert lookup_name("other", ["b"], tables) is None
    assert lookup_name("", ["b"], tables) is None


@given(st.text(max_size=70))
def test_label_rule(text: str) -> None:
    ok = (
        1 <= len(text) <= 63
        and all(c in "abcdefghijklmnopqrstuvwxyz0123456789-" for c in text)
        and not text.startswith("-")
        and not text.endswith("-")
    )
    assert is_label(text) == ok
