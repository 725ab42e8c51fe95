"""One weight update's waits and its swap (`WeightReceiver._apply`), each wait ending with the
call's deadline: `Waits` (the update's budget and its peer; a wait that passed, logged and raised
as `DeadlineExceeded` naming its phase) and `Swapper` (the swap run by the server's compute thread
between batches, the server alive but not ready while it waits)."""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..common.rpc.errors import BadRequest, DeadlineExceeded
from ..common.rpc.waits import wait_failed

log = logging.getLogger("services.weights.receiver")  # its lines read as the receiver's, as before


class Waits:
    """The waits of one weight update, from its start: each ends with `budget`, the seconds the
    update may wait (the call's remaining deadline; `timeout_s` for a pull, no call, or a call
    without a deadline); `peer` is where the version comes from."""

    NO_DEADLINE_S = 1e7  # what gRPC reports as the time left of a call without a deadline is beyond this

    def __init__(self, context, timeout_s: float, origin: str = ""):
        self.t0 = time.monotonic()
        remaining = context.time_remaining() if context is not None else None
        if remaining is None or remaining > self.NO_DEADLINE_S:
            self.budget = timeout_s
        else:
            self.budget = max(float(remaining), 0.0)
        self.peer = origin or (context.peer() if context is not None else "?")

    def left(self) -> float:
        """Seconds left of the budget."""
        return max(self.budget - (time.monotonic() - self.t0), 0.0)

    def passed(self, what: str, phase: str, why: str) -> DeadlineExceeded:
        """The wait for `phase` passed the budget: logged, and the error to raise."""
        msg = wait_failed(what, self.peer, phase, DeadlineExceeded(why), time.monotonic() - self.t0, self.budget)
        log.warning("%s", msg)
        return DeadlineExceeded(msg)


class Swapper:
    """Swaps a version in on the server's compute thread (`run(fn, timeout=)`: fn runs between
    batches; a run that has not started within `timeout` is withdrawn and raises a TimeoutError),
    the server (`readiness`: set_ready, liveness; or None) not ready meanwhile."""

    def __init__(self, run: Callable, readiness, backend):
        self.run, self.readiness, self.backend = run, readiness, backend

    def swap(self, fn: Callable[[], None], state: dict, waits: Waits, what: str) -> tuple[float, float]:
        """Run `fn` (the swap of `state`, the update `what` names) between batches within what is
        left of the update's budget ('swap': one that has not started by then is withdrawn,
        nothing changes); the seconds it waited for the running batch and its own. `state` is
        cleared at the end, whatever happened."""
        started: list[float] = []

        def swap():
            started.append(time.perf_counter())
            fn()
            started.append(time.perf_counter())

        server = self.readiness
        if server:
            server.set_ready(False)  # alive, not ready, while the swap waits for the batch
        t_queued = time.perf_counter()
        try:
            self.run(swap, timeout=waits.left())
        except TimeoutError as e:
            if started:
                raise
            raise waits.passed(what, "swap", f"not applied: {e}") from None
        except BadRequest:
            raise
        except (KeyError, ValueError) as e:
            raise BadRequest(f"weights: {e}") from None
        finally:
            state.clear()  # shared memory: the views go now, so the file unmaps without waiting for them
            if server and not self.backend.broken:
                server.set_ready(True)  # a broken engine stays not ready, and fails liveness
            elif server:
                server.liveness()  # says why now, not at the next probe
        return started[0] - t_queued, started[1] - started[0]
