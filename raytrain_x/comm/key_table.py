"""The job store's keys and values, with blocking waits (torch's `Store` semantics): what
`JobStoreServer` serves, apart from how it is reached."""

from __future__ import annotations

import threading
from collections.abc import Sequence


def compare_set_answer(current: bytes | None, expected: bytes,
                       desired: bytes) -> tuple[bool, bytes]:
    """torch's `compare_set`: (whether to store `desired`, the value to answer): it is
    stored when the key holds `expected` (or is absent and `expected` is empty); the
    answer is the value the key then holds, or `expected` for an absent key."""
    if (current is None and expected == b"") or current == expected:
        return True, desired
    return False, current if current is not None else expected


class KeyTable:
    """Keys and values with blocking waits; the semantics of torch's `Store`."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._changed:
            store, answer = compare_set_answer(self._data.get(key), expected, desired)
            if store:
                self._data[key] = desired
                self._changed.notify_all()
            return answer

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: all(k in self._data for k in keys),
                                          timeout_s)

    def get(self, key: str, timeout_s: float) -> bytes | None:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._data, timeout_s):
                return None
            return self._data[key]

    def check(self, keys: Sequence[str]) -> bool:
        with self._changed:
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._changed:
            return len(self._data)
