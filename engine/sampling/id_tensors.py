"""Host int64 arrays of the token-id lists the penalties count, converted once per list and grown by what was
appended since, so a step's penalty inputs cost O(new tokens) in Python instead of O(prompt + output).

Why: converting Python ints is the penalties' host cost. At batch 256 with 1024-token prompts and 512 outputs,
`torch.tensor` over the step's flattened ids took 28 ms for the prompts alone on the CI CPU, every step; joining
cached arrays takes about 1 ms (docs/results.md, "Penalty inputs' host cost"). numpy arrays, not tensors: the
per-list work stays out of torch's dispatcher, so a step's torch ops do not grow with its rows (tests/test_sampler.py
counts them).

What it relies on: a request's prompt list is never written after the request is made and its output list only
grows (the scheduler's ScheduledRow says so). Both are checked as far as is cheap: a list shorter than what was
converted, or whose last converted element changed, is converted again whole. A list made fresh each step (a
verify row's outputs plus drafts) is a miss each time and costs what it always did.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

CACHED_IDS = 8 << 20          # ids held over all lists (64 MiB of int64); least recently used lists go first
CACHED_LISTS = 4096           # and lists held (two a request: 2048 requests in flight)


class IdTensors:
    """id(list) -> (the list, a growable int64 array, how many of its ids are converted). Holding the list keeps
    its id from being reused while the entry lives."""

    def __init__(self, capacity: int = CACHED_IDS, max_lists: int = CACHED_LISTS):
        self.capacity, self.max_lists = capacity, max_lists
        self.held = 0                                              # buffer elements over all entries
        self._entries: OrderedDict[int, list] = OrderedDict()      # id -> [list, buffer, converted]

    def __call__(self, ids: list[int]) -> np.ndarray:
        """The list's ids as an int64 array (a view of the cache: read it, do not write it)."""
        key = id(ids)
        entry = self._entries.get(key)
        n = len(ids)
        if entry is not None and self._still_prefix(entry, ids):
            self._entries.move_to_end(key)
            done = entry[2]
            if n > done:
                buf = entry[1]
                if n > buf.shape[0]:
                    grown = np.empty(max(n, 2 * buf.shape[0]), dtype=np.int64)
                    grown[:done] = buf[:done]
                    self.held += grown.shape[0] - buf.shape[0]
                    entry[1] = buf = grown
                buf[done:n] = ids[done:n]
                entry[2] = n
            return entry[1][:n]
        if entry is not None:
            self._drop(key)
        buf = np.array(ids, dtype=np.int64)
        self._entries[key] = [ids, buf, n]
        self.held += buf.shape[0]
        while len(self._entries) > 1 and (self.held > self.capacity or len(self._entries) > self.max_lists):
            self._drop(next(iter(self._entries)))
        return buf[:n]

    @staticmethod
    def _still_prefix(entry: list, ids: list[int]) -> bool:
        done = entry[2]
        return len(ids) >= done and (done == 0 or ids[done - 1] == int(entry[1][done - 1]))

    def _drop(self, key: int) -> None:
        self.held -= self._entries.pop(key)[1].shape[0]
