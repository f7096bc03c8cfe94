"""Device prefetch: the next training batches are read, converted and put on the devices on a
background thread while the current step runs (``data.prefetch``)."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

__all__ = ["DevicePrefetcher"]

_DONE = object()


class DevicePrefetcher:
    """Wraps a checkpointable host iterator (``next``, ``get_state``) and a ``put`` function (host
    batch -> device arrays): ``next(prefetcher)`` returns ``(device_batch, state)``, where ``state``
    is the iterator's state just after that batch was read, so saving it with a checkpoint taken
    after training on the batch resumes at the following one, however far the thread has read
    ahead.

    Args:
      iterator: e.g. the grain iterator of :func:`moefast.data.train_dataset`.
      put: host batch -> device batch (``Trainer.put_batch``); called on the background thread.
      size: batches in flight (read ahead of the one being trained on); 0 = no thread, each batch
        is read and put when asked for.

    The thread is a daemon and stops at :meth:`close` (or when the iterator ends). An exception
    in it (a data error) is raised by the ``next`` call that would have returned that batch.
    """

    def __init__(self, iterator: Iterator[dict[str, Any]], put: Callable[[dict[str, Any]], Any], size: int):
        self._it, self._put, self.size = iterator, put, size
        self._stop = threading.Event()
        self._thread = None
        if size > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=size)
            self._thread = threading.Thread(target=self._fill, name="moefast-prefetch", daemon=True)
            self._thread.start()

    def _read(self):
        batch = next(self._it)
        return self._put(batch), self._it.get_state()

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                item = self._read()
                while not self._stop.is_set():  # wait for room, but notice close()
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except StopIteration:
            self._offer(_DONE)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            self._offer(e)

    def _offer(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self):
        if self._thread is None:
            return self._read()
        item = self._queue.get()
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stops the thread (batches read ahead are dropped: the saved state does not include them)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
