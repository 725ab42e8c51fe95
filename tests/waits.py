"""Waiting for an event in a test: poll until it holds, with a generous deadline (a busy machine
makes things late, never wrong), never a fixed sleep followed by an assertion."""

import time


def wait_until(pred, what: str, timeout_s: float = 120.0, every_s: float = 0.01):
    """`pred()`'s first truthy value; an AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"never: {what} (waited {timeout_s:g} s)"
        time.sleep(every_s)
