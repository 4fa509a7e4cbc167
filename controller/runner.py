"""The sync runner: kube-proxy's BoundedFrequencyRunner (pkg/proxy/runner), in Python.

- ``run()`` asks for a run as soon as possible; requests during a run or during the
  cool-down coalesce into one.
- At least ``min_interval`` passes between the end of one run and the start of the next.
- At most ``max_interval`` passes between two runs (the periodic full resync).
- A run that raises is logged with its traceback and counted, never kills the loop, and
  is retried no later than the retry delay: ``retry_initial`` doubling up to
  ``retry_max`` while failures continue (kube-proxy retries after its sync period; a
  map write refused for a moment deserves a quicker second try), reset by a success.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("kxlb.runner")


class BoundedFrequencyRunner:
    def __init__(self, name: str, fn: Callable[[], None], min_interval: float, max_interval: float,
                 retry_initial: float = 1.0, retry_max: float = 30.0,
                 on_error: Callable[[BaseException], None] | None = None):
        if max_interval < min_interval:
            raise ValueError(f"{name}: max_interval {max_interval} < min_interval {min_interval}")
        self.name, self.fn = name, fn
        self.min_interval, self.max_interval = min_interval, max_interval
        self.retry_initial, self.retry_max = retry_initial, retry_max
        self.on_error = on_error
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0          # consecutive failed runs
        self.last_error: BaseException | None = None

    def run(self) -> None:
        if not self._wake.is_set():  # set() takes a lock and notifies: once is enough
            self._wake.set()

    def start(self) -> "BoundedFrequencyRunner":
        self._thread = threading.Thread(target=self.loop, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _next_delay(self) -> float:
        if not self.failures:
            return self.max_interval
        return min(self.max_interval, self.retry_max, self.retry_initial * 2 ** (self.failures - 1))

    def loop(self) -> None:
        """Run in the calling thread until stop() (start() runs it in a thread of its own)."""
        self._thread = threading.current_thread()
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.fn()
                self.failures, self.last_error = 0, None
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any bug or bad input
                self.failures += 1
                self.last_error = exc
                log.exception("%s: run failed (%d in a row); retrying in %.1f s", self.name, self.failures,
                              self._next_delay())
                if self.on_error is not None:
                    try:
                        self.on_error(exc)
                    except Exception:  # noqa: BLE001
                        log.exception("%s: error hook failed", self.name)
            deadline = time.monotonic() + self._next_delay()
            if self._stop.wait(self.min_interval):  # cool-down: requests meanwhile coalesce
                return
            self._wake.wait(max(0.0, deadline - time.monotonic()))
