"""A kept collection: values in memory, each also a record file, one change at a time.

A change is seen once it is kept: `put` and `remove` write the record first (on the records'
writer thread) and change the memory after, under the store's lock, which readers never take.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import trio

from .records import RecordDir

log = logging.getLogger(__name__)

T = TypeVar("T")


class Store(Generic[T]):
    def __init__(
        self,
        records: RecordDir,
        to_record: Callable[[T], dict[str, Any]],
        from_record: Callable[[dict[str, Any]], T],
    ) -> None:
        self._records = records
        self._to_record = to_record
        self._from_record = from_record
        self._items: dict[str, T] = {}
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

    def __contains__(self, record_id: str) -> bool:
        return record_id in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items.values()))

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> list[tuple[str, T]]:
        return list(self._items.items())

    async def put(self, record_id: str, value: T) -> Any:
        """Keep value; the caller holds `lock` when its change depends on what is there.

        Returns the record as a Cap'n Proto reader, which an answer can carry as it is.
        """
        reader = await self._records.put(record_id, self._to_record(value))
        self._items[record_id] = value
        return reader

    async def remove(self, record_id: str) -> None:
        await self._records.remove(record_id)
        self._items.pop(record_id, None)

    def close(self) -> None:
        self._records.close()
