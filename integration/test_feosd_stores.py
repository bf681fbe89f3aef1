"""feosd as a process, driven with feosctl as a user would: volumes, groups and name tables."""

from __future__ import annotations

import json
import textwrap

VOLUME = "0b5c5cf4-8f0e-4f7c-9b43-2a7e8b7c1d01"


def test_volume_life_cycle(feosd) -> None:  # type: ignore[no-untyped-def]
    created = feosd.ctl_json("volume", "create", VOLUME, "--size", "1GiB", "--label", "app=web")
    assert created["state"] == "available"
    assert created["sizeBytes"] == 1 << 30
    assert created["formatted"] is False

    # The same ID, size and labels find it; another size fails ALREADY_EXISTS (exit 16).
    again = feosd.ctl_json("volume", "create", VOLUME, "--size", "1024MiB", "--label", "app=web")
    assert again == created
    other = feosd.ctl("volume", "create", VOLUME, "--size", "2GiB", check=False)
    assert other.returncode == 16
    assert "ALREADY_EXISTS" in other.stderr

    listed = feosd.ctl("volume", "list").stdout
    assert VOLUME in listed and "1GiB" in listed and "app=web" in listed
    assert feosd.ctl_json("volume", "get", VOLUME) == created

    feosd.ctl("volume", "delete", VOLUME)
    missing = feosd.ctl("volume", "get", VOLUME, check=False)
    assert missing.returncode == 15
    assert f"NOT_FOUND: volume {VOLUME} does not exist" in missing.stderr


def test_bad_volumes_are_refused_naming_the_field(feosd) -> None:  # type: ignore[no-untyped-def]
    cases = {
        ("NOT-A-UUID", "1GiB"): "id: must be a lowercase UUID",
        (VOLUME.upper(), "1GiB"): "id: must be a lowercase UUID",
        (VOLUME, "32MiB"): "sizeBytes: must be from 64 MiB to 16 TiB in whole MiB",
        (VOLUME, "17TiB"): "sizeBytes: must be from 64 MiB to 16 TiB",
        (VOLUME, "67108865"): "sizeBytes: must be from 64 MiB to 16 TiB in whole MiB",
    }
    for (volume_id, size), message in cases.items():
        done = feosd.ctl("volume", "create", volume_id, "--size", size, check=False)
        assert done.returncode == 13, (volume_id, size, done.stderr)
        assert message in done.stderr
    label = feosd.ctl("volume", "create", VOLUME, "--size", "1GiB", "--label", "Bad Key=x",
                      check=False)
    assert label.returncode == 13
    assert "labels[0].key" in label.stderr
    assert feosd.ctl_json("volume", "list") == []


def test_records_survive_a_restart(feosd) -> None:  # type: ignore[no-untyped-def]
    feosd.ctl("volume", "create", VOLUME, "--size", "64MiB")
    assert feosd.stop() == 0
    feosd.start()
    assert [v["id"] for v in feosd.ctl_json("volume", "list")] == [VOLUME]


def test_a_broken_record_is_set_aside_not_fatal(feosd) -> None:  # type: ignore[no-untyped-def]
    feosd.ctl("volume", "create", VOLUME, "--size", "64MiB")
    feosd.stop()
    broken = feosd.state_dir / "volumes" / "c2d6c3a8-5e7f-4b1a-9d3e-0f1e2d3c4b5a.pb"
    broken.write_bytes(b"\xff\x00garbage that is no capnp message")
    feosd.start()
    assert [v["id"] for v in feosd.ctl_json("volume", "list")] == [VOLUME]
    assert not broken.exists()
    assert list(broken.parent.glob(broken.name + ".broken-*"))
    assert broken.name in feosd.log_text()


def test_security_group_life_cycle(feosd, tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = tmp_path / "web.yaml"
    spec.write_text(textwrap.dedent("""\
        id: web
        rulesIn:
          - protocol: tcp
            firstPort: 443
            lastPort: 443
            peer: {block: {cidr: "2001:db8::/32"}}
        rulesOut:
          - protocol: any
            peer: {group: db}
        """))
    put = feosd.ctl_json("group", "put", str(spec))
    assert put["id"] == "web"
    assert put["rulesIn"][0]["peer"]["block"]["cidr"] == "2001:db8::/32"
    assert "tcp:443 2001:db8::/32" in feosd.ctl("group", "get", "web").stdout
    assert [g["id"] for g in feosd.ctl_json("group", "list")] == ["web"]

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"id": "web", "rulesIn": [{"protocol": "icmp", "firstPort": 80,
                                                           "lastPort": 80,
                                                           "peer": {"block": {"cidr": "10.0.0.0/8"}}}]}))
    refused = feosd.ctl("group", "put", str(bad), check=False)
    assert refused.returncode == 13
    assert "rules_in[0]" in refused.stderr
    # The group accepted before is still there, unchanged.
    assert feosd.ctl_json("group", "get", "web") == put

    feosd.ctl("group", "delete", "web")
    assert feosd.ctl("group", "get", "web", check=False).returncode == 15


def test_name_table_life_cycle_and_deltas(feosd, tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = tmp_path / "t.yaml"
    spec.write_text("id: web\nversion: 1\nnames:\n  - name: db\n    addresses: [fd00::5, 127.0.0.2]\n")
    feosd.ctl("names", "put", str(spec))
    updated = feosd.ctl_json("names", "update", "web", "--from", "1", "--to", "7",
                             "--put", "cache=fd00::6", "--remove", "db")
    assert updated["version"] == 7
    assert updated["names"] == [{"name": "cache", "addresses": ["fd00::6"]}]

    stale = feosd.ctl("names", "update", "web", "--from", "1", "--to", "8", "--put", "x=::1",
                      check=False)
    assert stale.returncode == 19  # FAILED_PRECONDITION
    assert "version 1" in stale.stderr and "version 7" in stale.stderr

    bad_name = feosd.ctl("names", "update", "web", "--from", "7", "--to", "8",
                         "--put", "Not_A_Label=::1", check=False)
    assert bad_name.returncode == 13
    assert feosd.ctl_json("names", "get", "web")["version"] == 7

    feosd.ctl("names", "delete", "web")
    assert feosd.ctl_json("names", "list") == []
