"""One process's results of a per-dtype hardware probe, measured once, injectable by tests (`float32.bias_gradient`)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Sequence


class ProbeCache:
    """Probe results by dtype: measured ones kept in `cache` (tests save and restore it), injected ones on top."""

    def __init__(self) -> None:
        self.cache: Dict[str, Any] = {}
        self._injected: List[Any] = []
        self._mutex = threading.RLock()

    def get(self, dtype: str, measure: Callable[[str], Any]) -> Any:
        """The injected result for `dtype` (its ``.dtype``), else the kept one, else ``measure(dtype)``, kept."""
        with self._mutex:
            for result in reversed(self._injected):
                if result.dtype == dtype:
                    return result
            if dtype in self.cache:
                return self.cache[dtype]
            self.cache[dtype] = measure(dtype)
            return self.cache[dtype]

    @contextlib.contextmanager
    def injected(self, results: Sequence[Any]) -> Iterator[List[Any]]:
        """Makes `get` return `results` (one per ``.dtype``) inside the block; yields them as a list."""
        results = list(results)
        with self._mutex:
            self._injected.extend(results)
        try:
            yield results
        finally:
            with self._mutex:
                for result in results:
                    self._injected.remove(result)
