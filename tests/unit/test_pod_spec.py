"""PodSpec's rules at the API's edge, pod IDs, the life cycle's table and the events' hub."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.pods import _lifecycle as lc
from feos.pods._events import EventHub
from feos.pods._spec import CROCKFORD, check_pod_id, is_image_reference, new_pod_id, parse_spec

VOLUME = "3f0c2a51-6b7e-4d1c-9a8f-2e5d4c3b2a10"

labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
images = st.sampled_from(["busybox", "127.0.0.1:5000/busybox:1", "registry.example/app/web:v2",
                          "localhost/x@sha256:" + "a" * 64])
containers = st.builds(
    lambda name, image, cmd, env: {"name": name, "image": image, "command": cmd,
                                   "env": [{"key": k, "value": v} for k, v in env]},
    labels, images, st.lists(st.text(alphabet=st.characters(blacklist_characters="\0"), max_size=8),
                             max_size=3),
    st.lists(st.tuples(st.from_regex(r"[A-Z_][A-Z0-9_]{0,5}", fullmatch=True), st.text(max_size=5)),
             max_size=3))
good_specs = st.fixed_dictionaries({
    "vcpus": st.integers(1, 32),
    "memoryMib": st.integers(64, 131072).map(lambda m: m * 2),
    "containers": st.lists(containers, max_size=3, unique_by=lambda c: c["name"]),
    "network": st.sampled_from([{"none": None}, {"pod": {}},
                                {"pod": {"securityGroups": ["web"], "nameTables": ["t1"]}}]),
    "metadataJson": st.sampled_from(["", "{}", '{"role":"web"}']),
})


@given(good_specs)
def test_a_valid_spec_is_kept_as_it_is_compared(data: dict[str, Any]) -> None:
    spec = parse_spec(data)
    assert parse_spec(spec.to_dict()) == spec
    assert spec.vcpus == data["vcpus"]
    assert [c.name for c in spec.containers] == [c["name"] for c in data["containers"]]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=15)


@given(st.dictionaries(st.sampled_from(["vcpus", "memoryMib", "containers", "network", "volumes",
                                        "metadataJson", "diskSizeMib"]), json_values))
def test_any_input_is_a_spec_or_an_invalid_argument(data: dict[str, Any]) -> None:
    try:
        parse_spec(data)
    except FeosError as exc:
        assert exc.code is Code.INVALID_ARGUMENT
        assert exc.message.startswith("spec")


def test_defaults_and_named_fields() -> None:
    spec = parse_spec({})
    assert (spec.vcpus, spec.memory_mib, spec.network is not None) == (1, 512, True)
    cases = {
        "spec.vcpus": {"vcpus": 33},
        "spec.memoryMib": {"memoryMib": 513},
        "spec.volumes[1].name": {"volumes": [{"name": "a", "volumeId": VOLUME},
                                             {"name": "a", "volumeId": str(uuid.uuid4())}]},
        "spec.volumes": {"volumes": [{"name": f"v{i}", "volumeId": str(uuid.uuid4())}
                                     for i in range(9)]},
        "spec.containers[1].name": {"containers": [{"name": "a", "image": "busybox"},
                                                   {"name": "a", "image": "busybox"}]},
        "spec.containers[0].env[0].key": {"containers": [{"name": "a", "image": "busybox",
                                                          "env": [{"key": "1X"}]}]},
        "spec.network.securityGroups[0]": {"network": {"pod": {"securityGroups": ["Bad"]}}},
        "spec.metadata": {"metadataJson": json.dumps({"bad key": 1})},
    }
    for field, data in cases.items():
        with pytest.raises(FeosError) as caught:
            parse_spec(data)
        assert caught.value.message.startswith(field), (field, caught.value.message)


def test_image_references() -> None:
    for good in ("busybox", "library/busybox:1.36", "127.0.0.1:5000/a/b:c", "[::1]:5000/x"):
        assert is_image_reference(good), good
    for bad in ("", "UPPER/case", "a:b:c", "busybox:", "/abs", "a//b"):
        assert not is_image_reference(bad), bad


@given(st.integers(0, 1000))
def test_minted_ids_are_ids(draw: int) -> None:
    del draw  # only the number of examples: each mints an ID of its own
    pod_id = new_pod_id()
    assert check_pod_id(pod_id) == pod_id
    assert pod_id[0] not in "0123456789"
    assert set(pod_id) <= set(CROCKFORD)


@given(st.text(max_size=40))
def test_other_ids_are_refused(text: str) -> None:
    try:
        check_pod_id(text)
    except FeosError as exc:
        assert exc.code is Code.INVALID_ARGUMENT
    else:
        assert len(text) in (11, 36)


def test_the_table_refuses_what_a_state_does_not_allow() -> None:
    assert lc.next_state(lc.PENDING, "up") == lc.RUNNING
    assert lc.next_state(lc.RUNNING, "crashed") == lc.FAILED
    assert lc.next_state(lc.RUNNING, "stopped") == lc.STOPPED
    assert lc.next_state(lc.FAILED, "start") == lc.PENDING
    assert lc.next_state(lc.SUSPENDED, "resume") == lc.RUNNING
    with pytest.raises(FeosError, match="only a running pod can be suspended") as caught:
        lc.next_state(lc.STOPPED, "suspend", "p")
    assert caught.value.code is Code.FAILED_PRECONDITION
    with pytest.raises(FeosError, match="only a suspended or hibernated pod can be resumed"):
        lc.next_state(lc.PENDING, "resume", "p")


async def test_watchers_get_their_pods_events_in_order() -> None:
    hub = EventHub()
    every, one = hub.watch(), hub.watch("pa")
    hub.publish("pa", "pending")
    hub.publish("pb", "pending")
    hub.publish("pa", "running")
    got = await every.next({"max": 10})
    assert [(e["podId"], e["state"]) for e in got["events"]] == [
        ("pa", "pending"), ("pb", "pending"), ("pa", "running")]
    assert [e["sequence"] for e in got["events"]] == [1, 2, 3]
    mine = await one.next({})
    assert [e["state"] for e in mine["events"]] == ["pending", "running"]
    hub.close()
    assert (await every.next({}))["end"] is True
