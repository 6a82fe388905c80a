"""One process's results of a per-dtype hardware probe, measured once, injectable by tests.

Used by `tfmp._src.float32.gelu` and `tfmp._src.float32.bias_gradient`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Sequence


class ProbeCache:
    """Probe results by dtype: measured ones kept for the process, injected ones on top.

    Attributes:
        cache: Dict, dtype string -> the result measured in this process (tests
            save and restore it).
    """

    def __init__(self) -> None:
        self.cache: Dict[str, Any] = {}
        self._injected: List[Any] = []
        self._mutex = threading.RLock()

    def get(self, dtype: str, measure: Callable[[str], Any], keep: Callable[[Any], bool] = lambda found: True) -> Any:
        """The injected result for `dtype` (its ``.dtype``), else the kept one, else ``measure(dtype)``.

        Args:
            dtype: String. ``"bfloat16"`` or ``"float16"``.
            measure: Callable ``dtype -> result``, run under the lock (one measurement at a time).
            keep: Callable ``result -> bool``: whether a fresh measurement is kept
                (False for one that must be taken again, e.g. asked while tracing).
        """
        with self._mutex:
            for result in reversed(self._injected):
                if result.dtype == dtype:
                    return result
            if dtype in self.cache:
                return self.cache[dtype]
            found = measure(dtype)
            if keep(found):
                self.cache[dtype] = found
            return found

    def clear(self) -> None:
        """Forgets the measured results; the next `get` of each dtype measures again."""
        with self._mutex:
            self.cache.clear()

    @contextlib.contextmanager
    def injected(self, results: Sequence[Any]) -> Iterator[List[Any]]:
        """Makes `get` return `results` (one per ``.dtype``) inside the block.

        Yields:
            List of `results`.
        """
        results = list(results)
        with self._mutex:
            self._injected.extend(results)
        try:
            yield results
        finally:
            with self._mutex:
                for result in results:
                    self._injected.remove(result)
