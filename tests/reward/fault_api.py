"""A real reward API on loopback (OpenRLHF's protocol, standard library HTTP server in a thread)
that fails on demand. The reward of a query is its length, so a reward that did not come from it
shows. Each request's answer is the next of `script`, else the one of `poison` when one of its
prompts is `poison[0]`, else `mode`:

    ok        200 {"rewards": [len(query), ...]} (after `delay_s`; while `gate` is set to an
              Event, only once it is set: the test decides when an answer comes)
    500 503   that status (503 with `retry_after` as Retry-After when set)
    429       429 with Retry-After `retry_after` (when set)
    400 422   that status, its body echoing the request's auth header and all its headers
              (a leak would show)
    401 403 404   that status, echoing the headers too
    hang      no answer until `hang_s` passes (or `close()`)
    close     the connection closed without an answer
    bad       one reward short
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FaultAPI:
    def __init__(self, mode: str = "ok"):
        self.mode, self.script, self.poison = mode, [], None
        self.retry_after: str | None = None
        self.delay_s, self.hang_s = 0.0, 30.0
        self.gate: threading.Event | None = None
        self.requests: list[dict] = []  # {"t": monotonic, "mode", "headers", "n", "prompts"}
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        self._release = threading.Event()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with api._lock:
                    if api.script:
                        mode = api.script.pop(0)
                    elif api.poison and api.poison[0] in (body.get("prompts") or []):
                        mode = api.poison[1]
                    else:
                        mode = api.mode
                    api.requests.append(
                        {
                            "t": time.monotonic(),
                            "mode": mode,
                            "headers": dict(self.headers),
                            "n": len(body["query"]),
                            "prompts": body.get("prompts"),
                        }
                    )
                    api.in_flight += 1
                    api.max_in_flight = max(api.max_in_flight, api.in_flight)
                try:
                    self._answer(mode, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with api._lock:
                        api.in_flight -= 1

            def _answer(self, mode, body):
                if mode == "close":
                    self.close_connection = True
                    return
                if mode == "hang":
                    api._release.wait(api.hang_s)
                    return
                if mode in ("500", "503", "429"):
                    self.send_response(int(mode))
                    if api.retry_after is not None and mode in ("503", "429"):
                        self.send_header("Retry-After", api.retry_after)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if mode in ("400", "422", "401", "403", "404"):
                    data = json.dumps(
                        {
                            "error": "no",
                            "your_auth": self.headers.get("Authorization"),
                            "your_headers": dict(self.headers),
                        }
                    ).encode()
                    return self._send(int(mode), data)
                if api.gate is not None:
                    api.gate.wait(api.hang_s)
                if api.delay_s:
                    time.sleep(api.delay_s)
                rewards = [float(len(q)) for q in body["query"]]
                if mode == "bad":
                    rewards = rewards[:-1]
                self._send(200, json.dumps({"rewards": rewards}).encode())

            def _send(self, code, data):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="fault-api").start()

    def count(self, since: float = 0.0) -> int:
        """Requests received since monotonic time `since`."""
        with self._lock:
            return sum(1 for r in self.requests if r["t"] >= since)

    def wait_for(self, what, pred, timeout_s: float = 60.0) -> None:
        """Until `pred(self)` holds (checked under the lock), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if pred(self):
                    return
            time.sleep(0.01)
        raise AssertionError(f"the reward API never saw {what} in {timeout_s:g}s")

    def gaps(self) -> list[float]:
        """Seconds between consecutive requests."""
        ts = [r["t"] for r in self.requests]
        return [b - a for a, b in zip(ts, ts[1:])]

    def close(self) -> None:
        self._release.set()
        if self.gate is not None:
            self.gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()
