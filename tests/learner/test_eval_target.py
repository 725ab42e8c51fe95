"""The eval target: a generation server that failed is avoided for a while, then used again
(a restarted server at the same address must not be shut out for the rest of the wait)."""
import threading
import time

from services.learner.broadcast import WeightBroadcaster


class _Store:
    def live(self, kind):
        return {"127.0.0.1:1": {"version": 5}}


def test_an_avoided_eval_target_is_used_again_when_its_time_is_up():
    b = WeightBroadcaster.__new__(WeightBroadcaster)
    b.store, b._clients = _Store(), {}
    b.client = lambda address: address
    t0 = time.time()
    avoid = {"127.0.0.1:1": t0 + 0.5}
    assert b.serving(5, 10, threading.Event(), avoid=avoid) == "127.0.0.1:1"
    assert time.time() - t0 >= 0.5  # not before its time was up (and then it was used)
