"""Device prefetch: order, the state returned with each batch, errors and closing."""

import threading
import time

import pytest

from moefast.train.prefetch import DevicePrefetcher


class Counter:
    """A checkpointable iterator: 0, 1, 2, ... (``fail_at``: raises there; ``stop_at``: ends)."""

    def __init__(self, fail_at=None, stop_at=None):
        self.i, self.fail_at, self.stop_at = 0, fail_at, stop_at

    def __next__(self):
        if self.i == self.fail_at:
            raise ValueError(f"bad record {self.i}")
        if self.i == self.stop_at:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def get_state(self):
        return {"next": self.i}


@pytest.mark.parametrize("size", [0, 1, 3])
def test_batches_in_order_with_the_state_after_each(size):
    p = DevicePrefetcher(Counter(), lambda b: ("on device", b), size)
    got = [next(p) for _ in range(6)]
    assert got == [(("on device", i), {"next": i + 1}) for i in range(6)]
    p.close()


def test_reads_at_most_size_batches_ahead():
    it = Counter()
    p = DevicePrefetcher(it, lambda b: b, 2)
    next(p)
    time.sleep(0.3)
    assert it.i <= 1 + 2 + 1  # the one taken, 2 queued, 1 read and waiting for room
    p.close()


def test_errors_and_the_end_reach_the_consumer():
    p = DevicePrefetcher(Counter(fail_at=2), lambda b: b, 2)
    assert [next(p)[0] for _ in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="bad record 2"):
        next(p)
    p.close()
    p = DevicePrefetcher(Counter(stop_at=1), lambda b: b, 2)
    assert next(p)[0] == 0
    with pytest.raises(StopIteration):
        next(p)
    p.close()


def test_close_stops_the_thread():
    p = DevicePrefetcher(Counter(), lambda b: b, 1)
    next(p)
    p.close()
    assert not any(t.name == "moefast-prefetch" and t.is_alive() for t in threading.enumerate())
