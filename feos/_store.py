"""A kept collection: values in memory, each also a record file, one change at a time.

A change is seen once it is kept: `put` and `remove` queue the record's change to the records'
writer and change the memory when the writer says it is on disk (on the thread that asked for the
change, in the order the changes were kept), and only then return. Callers in trio take the
store's `lock` when their change depends on what is there; readers never take it.

A create need not hold any lock while its record is written: it calls `stage` and awaits `kept`,
and concurrent creates share the writer's group commits. `pending` sees a staged put not yet
settled, so that a second create of the same ID finds the first and waits for it rather than
writing again. A service may run its creates on the Cap'n Proto thread (feos.pods' volumes do:
no trip to trio and back) while its other changes run in trio: the memory is then changed from
two threads, each short step whole under a mutex; the service keeps apart what the two do (a
create only adds what is not there; trio's changes touch only what is).

Every wait for a record is bounded (`within`, seconds): one not kept in time fails its caller
with DEADLINE_EXCEEDED naming the record, and the memory stays as the disk has it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import attrs
import trio

from .records import WRITE_TIMEOUT, Change, RecordDir

log = logging.getLogger(__name__)

T = TypeVar("T")

OnKept = Callable[[str, Any], None]
"""Called with (record_id, reader) once a put is kept, (record_id, None) once a removal is."""


@attrs.frozen(eq=False)
class Staged(Generic[T]):
    """A put queued to the disk and not yet known to be kept."""

    record_id: str
    value: T
    change: Change


class Store(Generic[T]):
    def __init__(
        self,
        records: RecordDir,
        to_record: Callable[[T], dict[str, Any]],
        from_record: Callable[[dict[str, Any]], T],
        on_kept: OnKept = lambda _id, _reader: None,
    ) -> None:
        self._records = records
        self._to_record = to_record
        self._from_record = from_record
        self._on_kept = on_kept
        self._items: dict[str, T] = {}
        self._staged: dict[str, Staged[T]] = {}
        self._mutex = threading.Lock()  # the memory's steps, whole, whichever thread runs them
        self.lock = trio.Lock()

    def load(self) -> None:
        """Read every record; one that does not convert is reported and left out."""
        for record_id, data in self._records.load().items():
            try:
                self._items[record_id] = self._from_record(data)
            except Exception as exc:  # a record kept by an older feosd, or damaged
                log.error(
                    "record %s is not valid (%s): left out", self._records.path(record_id), exc
                )

    def get(self, record_id: str) -> T | None:
        return self._items.get(record_id)

    def pending(self, record_id: str) -> Staged[T] | None:
        """The put staged for the record and not yet settled (kept or failed), if any."""
        with self._mutex:
            staged = self._staged.get(record_id)
            if staged is not None and staged.change.done:  # kept (then gone) or failed
                del self._staged[record_id]
                return None
            return staged

    def __contains__(self, record_id: str) -> bool:
        return record_id in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items.values()))

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> list[tuple[str, T]]:
        return list(self._items.items())

    def stage(self, record_id: str, value: T) -> Staged[T]:
        """Queue value's record; `kept` waits for it (on the thread that called this)."""

        def kept(reader: Any) -> None:
            with self._mutex:
                self._items[record_id] = value
                if self._staged.get(record_id) is staged:
                    del self._staged[record_id]
            self._on_kept(record_id, reader)

        change = self._records.submit_put(record_id, self._to_record(value), kept)
        staged = Staged(record_id, value, change)
        with self._mutex:  # kept() runs later on this same thread: it finds the entry
            self._staged[record_id] = staged
        return staged

    async def kept(self, staged: Staged[T], *, within: float = WRITE_TIMEOUT) -> None:
        """Until the staged put is on disk and seen; FeosError if it failed or took too long."""
        await staged.change.wait(within)

    async def put(self, record_id: str, value: T, *, within: float = WRITE_TIMEOUT) -> None:
        """Keep value; the caller holds `lock` when its change depends on what is there."""
        await self.kept(self.stage(record_id, value), within=within)

    async def remove(self, record_id: str, *, within: float = WRITE_TIMEOUT) -> None:
        def kept() -> None:
            with self._mutex:
                self._items.pop(record_id, None)
            self._on_kept(record_id, None)

        await self._records.submit_remove(record_id, kept).wait(within)

    def close(self) -> None:
        self._records.close()
