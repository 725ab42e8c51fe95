"""Probe: the edges of every HTTP surface (the gateway, the reward server's /score) from outside,
as a hostile client would (issue 54's cases), each measured, nothing asserted.

    python benchmarks/probe_edges.py [--model runs/tiny-model] [--label after] [--root DIR]

Starts `rlhf serve generation`, `rlhf serve gateway` (and a second gateway with
`rpc.gateway.max_sessions=1` for the eviction case) and `rlhf serve reward` (the rules reward of
configs/tiny-cpu.yaml) as processes on the tiny model with a run token, from the checkout `--root`
(another tree: a baseline, run with this interpreter). For each case it prints and keeps the status
code, whether the answer is the one error shape (exactly `{"error": {"message", "type", "param",
"code"}}`), the wall time, and the serving process's resident memory from /proc: VmRSS before,
VmHWM (its peak, reset before the case through /proc/PID/clear_refs) and VmRSS after:

   1. a chat message `content: [0] * 2_500_000` (7.5 MB), and `[0] * 200_000` under the bound
   2. four 2 MB stop strings
   3. POST /score of 4,000,000 samples (48 MB), of 70,000 (under the byte limit), of 48 samples
      of 1 MB (48 MB, few JSON values) and of 60,000 samples of 1 KB (60 MB, under every bound)
   4. 8 MiB of `{},` as `messages` and as the whole body, 8 MiB of short stop strings; ten of the
      first at once
   5. 20 slowloris connections, 200 silent ones, 20 bodies stopped short: closed? when? memory
   6. a session id with a space at either end (x-session-id header, body session_id)
   7. n x (prompt + max_tokens) over rpc.max_request_tokens: 400 naming the bound, not 429
   8. ten streams whose client hangs up after 0.3 s: how long until a fresh turn is fast again,
      and what the sessions recorded (404 expected)
   9. a refused request's session (the sessions gauge, GET /v1/sessions/{id}); an evicted
      session's next turn (410 session_evicted expected)
  10. /health after the generation server is killed and restarted on its port: the time from
      the first /health 200 to the first turn served
  11. a malformed Content-Length, malformed tool_calls, top_p 1e-300
  12. /v1/completions of a text prompt vs its token ids with the BOS token: the same context

Writes runs/bench/probe_edges-<label>.json (the services' logs under runs/bench/probe_edges-<label>/).
"""

from __future__ import annotations

import argparse
import json
import re
import select
import socket
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gateway import start  # noqa: E402  (the same start as the gateway benchmark's)
from benchmarks.probe_gateway import memory  # noqa: E402  (VmRSS and VmHWM from /proc, as that probe reads them)

TOKEN = "probe-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "abc="}], "max_tokens": 4}
SHAPE = {"message", "type", "param", "code"}


# ---------------------------------------------------------------- measuring
def reset_peak(pid: int) -> bool:
    """VmHWM back to VmRSS (Linux's clear_refs 5), so that a case's peak is its own."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Watch:
    """A case's memory: RSS before, the peak (VmHWM after a reset), RSS after (`settle` s later)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.before = memory(pid)["VmRSS"]
        self.reset = reset_peak(pid)

    def done(self, settle: float = 1.0) -> dict:
        hwm = memory(self.pid)["VmHWM"]
        time.sleep(settle)
        after = memory(self.pid)
        return {
            "rss_before_mb": round(self.before),
            "hwm_mb": round(max(hwm, after["VmHWM"])) if self.reset else None,
            "rss_after_mb": round(after["VmRSS"]),
        }


def shape_of(payload: bytes | str) -> bool:
    """The one error shape: exactly {"error": {"message", "type", "param", "code"}}."""
    try:
        body = json.loads(payload)
        e = body["error"]
    except Exception:
        return False
    return (
        set(body) == {"error"}
        and isinstance(e, dict)
        and set(e) == SHAPE
        and isinstance(e["message"], str)
        and (e["code"] is None or isinstance(e["code"], str))
        and (e["param"] is None or isinstance(e["param"], str))
    )


def error_fields(payload: bytes | str) -> dict:
    try:
        e = json.loads(payload)["error"]
        return {"code": e.get("code"), "param": e.get("param"), "message": str(e.get("message"))[:240]}
    except Exception:
        return {"text": (payload[:240].decode("utf-8", "replace") if isinstance(payload, bytes) else payload[:240])}


def raw(port: int, request: bytes, timeout: float = 60.0) -> dict:
    """One request written as bytes: the status, whether the answer is the one shape, the
    seconds until the server closed or answered whole, and the answer's first bytes."""
    t0 = time.perf_counter()
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(request)
        except OSError:
            pass
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                head, sep, body = data.partition(b"\r\n\r\n")
                m = re.search(rb"content-length:\s*(\d+)", head, re.I)
                if sep and m and len(body) >= int(m.group(1)):
                    break
        except OSError:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        status = 0
    return {
        "status": status,
        "shape_ok": shape_of(body) if status >= 400 or status == 0 else None,
        "seconds": round(time.perf_counter() - t0, 3),
        "head": head,
        "body": body,
    }


# ---------------------------------------------------------------- the probe
class Probe:
    def __init__(self, args):
        import httpx

        self.httpx = httpx
        self.args = args
        self.results: list[dict] = []
        self.logs = ROOT / "runs" / "bench" / f"probe_edges-{args.label}"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.root = Path(args.root).resolve()
        self.model = str(Path(args.model).resolve())
        self.config = self.logs / "probe.yaml"
        # rpc.max_request_tokens: the streams' n=16 x (prompt + max_tokens) fit; n=64 of them do not
        self.max_request_tokens = 24 * (64 + args.response_length)
        self.config.write_text(
            json.dumps(
                {
                    "model": {"path": self.model, "device": "cpu"},
                    "prompt_length": 64,
                    "response_length": args.response_length,
                    "rpc": {"auth_token": TOKEN, "max_request_tokens": self.max_request_tokens},
                    "reward": {
                        "type": "rules",
                        "rules": [{"name": "exact_match", "weight": 1.0}, {"name": "edit_distance", "weight": 1.0}],
                    },
                }
            )
        )
        self.procs: dict[str, object] = {}

    # services
    def serve(self, name: str, argv: list[str]):
        proc, ends = start(["serve", *argv, "-c", str(self.config)], self.logs / f"{name}.log", self.root)
        self.procs[name] = proc
        return proc, ends

    def start_all(self) -> None:
        self.gen, g = self.serve("gen", ["generation", "--port", "0", "--metrics-port", "-1"])
        self.gen_port = int(g["port"])
        gw_args = ["gateway", "--set", f"rpc.generation.port={self.gen_port}", "--port", "0"]
        self.gw, w = self.serve("gateway", gw_args + [a for kv in self.args.set for a in ("--set", kv)])
        self.port = int(w["http_port"])
        self.base = f"http://127.0.0.1:{self.port}"
        self.small, s = self.serve("gateway-small", gw_args + ["--set", "rpc.gateway.max_sessions=1"])
        self.small_base = f"http://127.0.0.1:{s['http_port']}"
        self.rw, r = self.serve("reward", ["reward", "--port", "0", "--http-port", "0", "--metrics-port", "-1"])
        self.reward_port = int(r["http_port"])

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except Exception:
                proc.kill()

    # requests
    def post(self, path: str, body, base: str | None = None, headers: dict | None = None, timeout: float = 180.0):
        """(response or the client's exception text, seconds)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h = {"content-type": "application/json", **AUTH, **(headers or {})}
        t0 = time.perf_counter()
        try:
            r = self.httpx.post(f"{base or self.base}{path}", content=data, headers=h, timeout=timeout)
        except self.httpx.HTTPError as e:
            return f"client: {type(e).__name__}: {e}"[:200], time.perf_counter() - t0
        return r, time.perf_counter() - t0

    def get(self, path: str, base: str | None = None):
        return self.httpx.get(f"{base or self.base}{path}", headers=AUTH, timeout=60)

    def row(self, case: str, r, seconds: float | None = None, **extra) -> dict:
        if isinstance(r, dict):  # raw()
            row = {"case": case, "status": r["status"], "shape_ok": r["shape_ok"], "seconds": r["seconds"]}
            if isinstance(r["status"], int) and (r["status"] >= 400 or r["status"] == 0):
                row.update(error_fields(r["body"]))
        elif isinstance(r, str):  # the client's exception
            row = {"case": case, "status": r, "shape_ok": None, "seconds": round(seconds or 0, 3)}
        else:
            row = {
                "case": case,
                "status": r.status_code,
                "shape_ok": shape_of(r.content) if r.status_code >= 400 else None,
            }
            row["seconds"] = round(seconds, 3) if seconds is not None else None
            if r.status_code >= 400:
                row.update(error_fields(r.content))
        row.update(extra)
        self.results.append(row)
        print(json.dumps(row), flush=True)
        return row

    def timed(self, case: str, path: str, body, pid: int | None = None, base: str | None = None, **kw) -> dict:
        watch = Watch(pid or self.gw.pid)
        r, took = self.post(path, body, base=base, **kw)
        return self.row(case, r, took, **watch.done())

    def sessions_gauge(self, base: str | None = None) -> float | None:
        text = self.get("/metrics", base).text
        m = re.search(r"^rlhf_gateway_sessions\{[^}]*\} (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    def chat_latency(self, base: str | None = None) -> float:
        r, took = self.post("/v1/chat/completions", CHAT, base=base, timeout=120)
        return took if not isinstance(r, str) and r.status_code == 200 else float("inf")

    # ------------------------------------------------------------ the cases
    def big_bodies(self) -> None:
        """1, 2, 4: bodies whose cost is not their size."""
        body = {**CHAT, "messages": [{"role": "user", "content": [0] * 2_500_000}]}
        self.timed("1. content [0]*2_500_000 (7.5 MB)", "/v1/chat/completions", body)
        body = {**CHAT, "messages": [{"role": "user", "content": [0] * 200_000}]}
        self.timed("1b. content [0]*200_000 (0.6 MB, under the JSON-values bound)", "/v1/chat/completions", body)
        body = {**CHAT, "stop": ["x" * 2_000_000] * 4}
        self.timed("2. four 2 MB stop strings", "/v1/chat/completions", body)

        limit = 8 << 20
        head, tail = b'{"model":"tiny","max_tokens":4,"messages":[', b"{}]}"
        count = (limit - len(head) - len(tail)) // 3
        messages = head + b"{}," * count + tail
        whole = b"[" + b"{}," * ((limit - 4) // 3) + b"{}]"
        alone = self.timed(f"4a. {len(messages):,} B of {{}} as messages", "/v1/chat/completions", messages)
        self.timed(f"4b. {len(whole):,} B of {{}} as the whole body", "/v1/chat/completions", whole)
        head = b'{"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":"abc="}],"stop":['
        strings = head + b'"ab",' * ((limit - len(head) - 8) // 5) + b'"ab"]}'
        self.timed(f"4d. {len(strings):,} B of short strings as stop", "/v1/chat/completions", strings)
        cost = (alone.get("hwm_mb") or 0) - alone.get("rss_before_mb", 0)
        if 10 * cost > self.args.max_rss_mb:  # ten at once would take the shared machine's memory
            self.row(
                "4c. ten of 4a at once",
                f"skipped: 4a alone took +{cost} MB, ten would be ~{10 * cost} MB > --max-rss-mb",
            )
            return
        watch = Watch(self.gw.pid)
        outs: list = [None] * 10

        def one(i):
            outs[i] = self.post("/v1/chat/completions", messages)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        took = time.perf_counter() - t0
        statuses = sorted({str(r.status_code) if not isinstance(r, str) else r[:60] for r, _ in outs})
        shapes = all(not isinstance(r, str) and shape_of(r.content) for r, _ in outs)
        first = outs[0][0]
        self.row(
            "4c. ten of 4a at once",
            first,
            took,
            **watch.done(),
            all_statuses=statuses,
            all_shape_ok=shapes,
        )

    def reward(self) -> None:
        """3: POST /score, 4,000,000 samples (48 MB) and 70,000 (under the byte limit)."""
        cases = [(4_000_000, b"abcd=dcba"), (70_000, b"abcd=dcba"), (48, b"ab=" * 333_333), (60_000, b"ab=" * 333)]
        for samples, query in cases:
            body = b'{"query":[' + b",".join([b'"%s"' % query] * samples) + b"]}"
            r, took = self.post_reward(body)
            watch_row = self.row_reward(
                f"3. /score of {samples:,} samples of {len(query):,} chars ({len(body) / 1e6:.1f} MB)",
                r,
                took,
                body_mb=round(len(body) / 1e6, 1),
            )
            if not isinstance(r, str):
                watch_row["answer_bytes"] = len(r.content)

    def post_reward(self, body: bytes):
        watch = Watch(self.rw.pid)
        t0 = time.perf_counter()
        try:
            r = self.httpx.post(
                f"http://127.0.0.1:{self.reward_port}/score",
                content=body,
                headers={"content-type": "application/json", **AUTH},
                timeout=300,
            )
        except self.httpx.HTTPError as e:
            r = f"client: {type(e).__name__}: {e}"[:200]
        took = time.perf_counter() - t0
        self._reward_mem = watch.done()
        return r, took

    def row_reward(self, *a, **kw):  # noqa: D401 (memory of the reward server in the row)
        return self.row(*a, **kw, **self._reward_mem)

    def held_connections(self) -> None:
        """5: slowloris headers, silent connections, bodies stopped short."""
        port, deadline = self.port, self.args.hold_s

        def closed_times(
            socks: list[socket.socket], t0: float, trickle: bool, until: float, answers: list[bytes] | None = None
        ) -> list[float | None]:
            """Seconds until each socket was closed by the server (None: still open `until` seconds
            after t0); a trickling socket sends another header line every second meanwhile; what
            each one was answered, into `answers` when given."""
            out: list[float | None] = [None] * len(socks)
            open_ = {s.fileno(): i for i, s in enumerate(socks)}
            last = time.monotonic()
            while open_ and time.monotonic() - t0 < until:
                ready, _, _ = select.select([socks[i] for i in open_.values()], [], [], 0.2)
                for s in ready:
                    i = open_[s.fileno()]
                    try:
                        data = s.recv(65536)
                    except OSError:
                        data = b""
                    if answers is not None:
                        answers[i] += data
                    if not data:
                        out[i] = round(time.monotonic() - t0, 2)
                        del open_[s.fileno()]
                if trickle and time.monotonic() - last >= 1.0:
                    last = time.monotonic()
                    for fd, i in list(open_.items()):
                        try:
                            socks[i].sendall(b"X-Pad: %d\r\n" % int(last))
                        except OSError:
                            out[i] = round(time.monotonic() - t0, 2)
                            del open_[fd]
            return out

        def summary(times):
            done = [t for t in times if t is not None]
            return {
                "closed": f"{len(done)}/{len(times)}",
                "close_s_min": min(done) if done else None,
                "close_s_max": max(done) if done else None,
            }

        # slowloris and silent connections together, a turn served meanwhile
        watch = Watch(self.gw.pid)
        t0 = time.monotonic()
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        for s in slow:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        res: dict = {}
        th = threading.Thread(target=lambda: res.update(silent=closed_times(silent, t0, False, deadline)))
        th.start()
        time.sleep(1)
        meanwhile = self.chat_latency()
        slow_times = closed_times(slow, t0, True, deadline)
        th.join()
        mem = watch.done(0.2)
        for s in slow + silent:
            s.close()
        self.row(
            "5a. 20 slowloris connections",
            {"status": "-", "shape_ok": None, "seconds": None, "body": b""},
            **summary(slow_times),
            turn_meanwhile_s=round(meanwhile, 3),
            **mem,
        )
        self.results[-1]["status"] = "closed" if None not in slow_times else "held"
        self.row(
            "5b. 200 silent connections",
            {"status": "-", "shape_ok": None, "seconds": None, "body": b""},
            **summary(res["silent"]),
            **mem,
        )
        self.results[-1]["status"] = "closed" if None not in res["silent"] else "held"

        # bodies stopped short: 7 MB of a declared 8 MB each
        watch = Watch(self.gw.pid)
        t0 = time.monotonic()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nContent-Length: 8000000\r\n\r\n"
        ).encode()
        stopped = []
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(head + b'{"messages":"' + b"x" * 7_000_000)
            stopped.append(s)
        sent_s = time.monotonic() - t0
        hwm_sent = memory(self.gw.pid)
        answers: list[bytes] = [b""] * 20
        times = closed_times(stopped, t0, False, deadline + 30, answers)
        mem = watch.done(0.5)
        for s in stopped:
            s.close()
        statuses = sorted({a.split(b" ", 2)[1].decode() if a.startswith(b"HTTP/") else "none" for a in answers})
        shapes = all(shape_of(a.partition(b"\r\n\r\n")[2]) for a in answers)
        self.row(
            "5c. 20 bodies stopped short (7 of 8 MB)",
            {"status": "-", "shape_ok": shapes, "seconds": None, "body": b""},
            **summary(times),
            statuses=statuses,
            rss_when_sent_mb=round(hwm_sent["VmRSS"]),
            sent_s=round(sent_s, 2),
            **mem,
        )
        self.results[-1]["status"] = ",".join(statuses)
        fields = error_fields(answers[0].partition(b"\r\n\r\n")[2])
        self.results[-1].update(fields)

    def session_ids(self) -> None:
        """6: a session id with a space at either end, in the header (raw: HTTP strips a field
        value's surrounding spaces) and in the body."""
        for sid in (" s-lead", "s-trail "):
            body = json.dumps({**CHAT, "session_id": sid}).encode()
            r, took = self.post("/v1/chat/completions", body)
            record = self.get(f"/v1/sessions/{sid.strip()}").status_code
            self.row(f"6. body session_id {sid!r}", r, took, session_record_stripped=record)
            payload = json.dumps(CHAT).encode()
            hid = "h" + sid.strip()
            value = f" {hid}" if sid.startswith(" ") else f"{hid} "
            request = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/json\r\nx-session-id: {value}\r\nConnection: close\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n"
            ).encode() + payload
            res = raw(self.port, request)
            echoed = re.search(rb"x-session-id: ?([^\r]*)", res["head"], re.I)
            record = self.get(f"/v1/sessions/{hid}").status_code
            self.row(
                f"6. header x-session-id {value!r}",
                res,
                session_record_stripped=record,
                echoed=echoed.group(1).decode() if echoed else None,
            )

    def request_cost(self) -> None:
        """7: n x (prompt + max_tokens) over rpc.max_request_tokens."""
        body = {**CHAT, "n": 64, "max_tokens": self.args.response_length, "session_id": "s-cost"}
        self.timed(
            f"7. n=64 x max_tokens={self.args.response_length} > {self.max_request_tokens}",
            "/v1/chat/completions",
            body,
        )
        self.results[-1]["session_record"] = self.get("/v1/sessions/s-cost").status_code

    def hang_ups(self) -> None:
        """8: ten streams whose client closes after 0.3 s."""
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "abcdefgh="}],
            "max_tokens": self.args.response_length,
            "n": 16,
            "temperature": 1.0,
            "stream": True,
        }
        base = [self.chat_latency() for _ in range(5)]
        normal = statistics.median(base)
        r, one_turn = self.post("/v1/chat/completions", {**body, "stream": False, "session_id": "drop-full"})
        tokens = r.json()["usage"]["completion_tokens"] if not isinstance(r, str) and r.status_code == 200 else None
        watch = Watch(self.gw.pid)
        gen_watch = Watch(self.gen.pid)

        def drop(i):
            h = {"content-type": "application/json", **AUTH, "x-session-id": f"drop-{i}"}
            try:
                self.httpx.post(
                    f"{self.base}/v1/chat/completions", content=json.dumps(body).encode(), headers=h, timeout=0.3
                )
            except self.httpx.HTTPError:
                pass

        threads = [threading.Thread(target=drop, args=(i,)) for i in range(10)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        t_closed = time.perf_counter()
        lat, busy = [], None
        while time.perf_counter() - t_closed < self.args.busy_s:
            took = self.chat_latency()
            lat.append(round(took, 3))
            if took <= max(3 * normal, normal + 0.1):
                busy = round(time.perf_counter() - t_closed, 2)
                break
        time.sleep(1.0)
        records = [self.get(f"/v1/sessions/drop-{i}") for i in range(10)]
        found = [r for r in records if r.status_code == 200]
        trajectories = sum(len(r.json().get("trajectories", [])) for r in found)
        self.row(
            "8. ten streams, client gone after 0.3 s",
            {"status": "-", "shape_ok": None, "seconds": busy, "body": b""},
            normal_turn_s=round(normal, 3),
            one_whole_stream_turn_s=round(one_turn, 2),
            its_completion_tokens=tokens,
            busy_until_fresh_turn_normal_s=busy,
            fresh_turn_latencies=lat[:20],
            session_records_200=len(found),
            trajectories_recorded=trajectories,
            record_statuses=sorted({r.status_code for r in records}),
            **watch.done(0.2),
            gen_hwm_mb=gen_watch.done(0)["hwm_mb"],
        )
        self.results[-1]["status"] = f"{10 - len(found)}/10 not recorded"

    def sessions(self) -> None:
        """9: a refused request's session; an evicted session's next turn."""
        before = self.sessions_gauge()
        too_long = {**CHAT, "session_id": "s-refused", "messages": [{"role": "user", "content": "ab=" * 40}]}
        r, took = self.post("/v1/chat/completions", too_long)
        after = self.sessions_gauge()
        record = self.get("/v1/sessions/s-refused").status_code
        self.row(
            "9a. refused request (context too long) with a session id",
            r,
            took,
            sessions_gauge=[before, after],
            session_record=record,
        )
        small = self.small_base
        a, _ = self.post("/v1/chat/completions", {**CHAT, "session_id": "evict-a"}, base=small)
        b, _ = self.post("/v1/chat/completions", {**CHAT, "session_id": "evict-b"}, base=small)
        reply = a.json()["choices"][0]["message"]["content"] if not isinstance(a, str) and a.status_code == 200 else "x"
        again = {
            **CHAT,
            "session_id": "evict-a",
            "messages": CHAT["messages"] + [{"role": "assistant", "content": reply}, {"role": "user", "content": "x="}],
        }
        r, took = self.post("/v1/chat/completions", again, base=small)
        record = self.get("/v1/sessions/evict-a", small)
        turns = [t.get("turns") for t in record.json().get("trajectories", [])] if record.status_code == 200 else None
        self.row(
            "9b. evicted session's next turn (max_sessions=1)",
            r,
            took,
            first_turns=[getattr(a, "status_code", a), getattr(b, "status_code", b)],
            record_after=record.status_code,
            record_turns=turns,
        )

    def malformed(self) -> None:
        """11: a malformed Content-Length, malformed tool_calls, top_p 1e-300."""
        for cl in ("1x", "-1", "3\r\nContent-Length: 4"):
            request = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {cl}\r\n\r\nabc"
            ).encode()
            self.row(f"11. Content-Length {cl!r}", raw(self.port, request, timeout=30))
        for calls in ([{"function": 5}], [{"function": {"name": "f", "arguments": {"a": 1}}}], "call f"):
            said = {"role": "assistant", "content": None, "tool_calls": calls}
            messages = [{"role": "user", "content": "abc="}, said, {"role": "user", "content": "again"}]
            r, took = self.post("/v1/chat/completions", {**CHAT, "messages": messages})
            self.row(f"11. tool_calls {json.dumps(calls)}", r, took)
        r, took = self.post("/v1/chat/completions", {**CHAT, "top_p": 1e-300})
        self.row("11. top_p 1e-300", r, took)

    def completions_context(self) -> None:
        """12: a text prompt and its token ids with BOS, greedy: the same prompt ids and text."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.model)
        text = "abcd="
        plain = tok(text, add_special_tokens=False)["input_ids"]
        with_bos = [tok.bos_token_id] + plain if tok.bos_token_id is not None else plain
        outs = {}
        for name, prompt in (("text", text), ("ids with BOS", with_bos), ("ids without BOS", plain)):
            r, took = self.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
            if not isinstance(r, str) and r.status_code == 200:
                c = r.json()["choices"][0]
                outs[name] = (c.get("prompt_token_ids"), c["text"])
            else:
                outs[name] = (None, getattr(r, "status_code", r))
        same = outs["text"] == outs["ids with BOS"] and outs["text"][0] is not None
        self.row(
            "12. /v1/completions text vs ids with BOS",
            {"status": "same" if same else "differ", "shape_ok": None, "seconds": None, "body": b""},
            bos=tok.bos_token_id,
            text_prompt_ids=outs["text"][0],
            text_reply=outs["text"][1],
            ids_with_bos_prompt_ids=outs["ids with BOS"][0],
            ids_with_bos_reply=outs["ids with BOS"][1],
            ids_without_bos_reply=outs["ids without BOS"][1],
        )

    def restart(self) -> None:
        """10: the generation server killed and restarted on its port."""
        self.gen.kill()
        self.gen.wait(30)
        t_kill = time.perf_counter()
        time.sleep(0.5)
        dead = self.httpx.get(f"{self.base}/health", timeout=10).status_code
        dead_turn, _ = self.post("/v1/chat/completions", CHAT, timeout=60)
        self.gen, _ = self.serve("gen2", ["generation", "--port", str(self.gen_port), "--metrics-port", "-1"])
        t_listening = time.perf_counter()
        t_health = t_turn = None
        failures: dict = {}
        while time.perf_counter() - t_listening < 60:
            if t_health is None:
                try:
                    if self.httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                        t_health = time.perf_counter()
                except self.httpx.HTTPError:
                    pass
                if t_health is None:
                    time.sleep(0.02)
                    continue
            r, _ = self.post("/v1/chat/completions", CHAT, timeout=60)
            code = getattr(r, "status_code", "client")
            if code == 200:
                t_turn = time.perf_counter()
                break
            key = f"{code} {error_fields(r.content).get('code') if not isinstance(r, str) else r[:40]}"
            failures[key] = failures.get(key, 0) + 1
            time.sleep(0.05)
        gap = round(t_turn - t_health, 3) if t_turn and t_health else None
        self.row(
            "10. /health 200 -> first turn served, after a restart on the same port",
            {"status": "-", "shape_ok": None, "seconds": gap, "body": b""},
            health_while_dead=dead,
            turn_while_dead=getattr(dead_turn, "status_code", dead_turn),
            turn_while_dead_shape_ok=shape_of(dead_turn.content) if not isinstance(dead_turn, str) else None,
            kill_to_listening_s=round(t_listening - t_kill, 2),
            listening_to_health_s=round(t_health - t_listening, 3) if t_health else None,
            health_to_turn_s=gap,
            failed_turns_between=failures,
        )
        self.results[-1]["status"] = "turn served" if t_turn else "no turn in 60 s"

    def run(self) -> None:
        t0 = time.time()
        self.start_all()
        try:
            r, took = self.post("/v1/chat/completions", CHAT)
            assert not isinstance(r, str) and r.status_code == 200, r
            steps = [
                self.big_bodies,
                self.reward,
                self.session_ids,
                self.request_cost,
                self.sessions,
                self.malformed,
                self.completions_context,
                self.hang_ups,
                self.held_connections,
                self.restart,
            ]
            only = set(self.args.only.split(",")) if self.args.only else None
            for step in steps:
                if only and step.__name__ not in only:
                    continue
                try:
                    step()
                except Exception as e:  # a probe step that broke: said, and the next one goes on
                    traceback.print_exc()
                    self.row(f"{step.__name__}: the probe itself failed", f"probe: {type(e).__name__}: {e}"[:300])
            for name, proc in self.procs.items():
                if proc.poll() is not None and name != "gen":
                    self.row(f"process {name} exited", f"exit {proc.returncode}")
        finally:
            self.stop_all()
        report(self.results, self.args, time.time() - t0)


def report(results: list[dict], args, seconds: float) -> None:
    """Writes runs/bench/probe_edges-<label>.json and prints the rows as a table."""
    out = ROOT / "runs" / "bench" / f"probe_edges-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"root": str(Path(args.root).resolve()), "seconds": round(seconds), "cases": results}, indent=1)
    )
    print(f"\n{len(results)} rows in {seconds:.0f} s -> {out}")
    print("\n| case | status | shape | s | RSS before | peak | RSS after | notes |\n|---|---|---|---|---|---|---|---|")
    keys = ("case", "status", "shape_ok", "seconds", "rss_before_mb", "hwm_mb", "rss_after_mb")
    for row in results:
        notes = {k: v for k, v in row.items() if k not in keys}
        print(
            f"| {row['case']} | {row['status']} | {row.get('shape_ok')} | {row.get('seconds')} | "
            f"{row.get('rss_before_mb', '')} | {row.get('hwm_mb', '')} | {row.get('rss_after_mb', '')} | "
            f"{json.dumps(notes) if notes else ''} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="runs/tiny-model")
    ap.add_argument("--label", default="probe")
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose services run (another tree: a baseline)")
    ap.add_argument(
        "--response-length", type=int, default=64, help="the config's response_length (the streams' max_tokens)"
    )
    ap.add_argument("--hold-s", type=float, default=20.0, help="how long case 5 waits for held connections to close")
    ap.add_argument("--busy-s", type=float, default=90.0, help="how long case 8 waits for a fresh turn to be fast")
    ap.add_argument("--max-rss-mb", type=float, default=6000, help="case 4c is skipped when it would need more")
    ap.add_argument("--only", default="", help="these steps alone, comma-separated (big_bodies,reward,...)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a gateway config override")
    Probe(ap.parse_args()).run()


if __name__ == "__main__":
    main()
