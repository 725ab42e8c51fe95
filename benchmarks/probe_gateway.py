"""Probe: `rlhf serve gateway` from outside, as a new user's security team would (issue 42's cases).

    python benchmarks/probe_gateway.py --model runs/tiny-model [--label after] [--big-mb 20]

Starts `rlhf serve generation` and `rlhf serve gateway` as processes on the tiny model with a run
token, then sends each case over real HTTP and prints its status code, whether the answer is
OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`, `code` a string or null)
and what else it shows; then memory: the gateway's resident memory (VmRSS, VmHWM from /proc)
around 100 requests with 1 MB session ids, 100 requests of one session with 1 MB in a field the
template never renders, and one authenticated chat message of `--mid-mb` MB then one of `--big-mb`
MB; last, /health with
the generation server killed. Writes runs/bench/probe_gateway-<label>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKEN = "probe-token-0123456789"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "abc="}], "max_tokens": 4}


from benchmarks.bench_gateway import start  # noqa: E402  (the same start as the gateway benchmark's)


def memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (the peak) of `pid`, in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def openai_shape(r) -> bool:
    try:
        e = r.json()["error"]
    except Exception:
        return False
    return (
        isinstance(e, dict)
        and set(e) >= {"message", "type", "param", "code"}
        and isinstance(e["message"], str)
        and (e["code"] is None or isinstance(e["code"], str))
    )


def raw(port: int, request: bytes, timeout: float = 120.0) -> tuple[int, bytes]:
    """One request written as bytes (a chunked body, a lying Content-Length); the status and
    the first KB of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(request)
        except OSError:
            pass  # the server answered and closed before the whole body went
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
    try:
        return int(data.split(b" ", 2)[1]), data[:1024]
    except (IndexError, ValueError):
        return 0, data[:1024]


def load(base: str, auth: dict, clients: int, seconds: float) -> dict:
    """`clients` threads for `seconds`, each running 2-turn sessions (the second turn extends
    the first): turn latency p50/p99, turns, errors, and whether every 2-turn record is exact."""
    import statistics
    import threading

    import httpx

    lat: list[float] = []
    errors, inexact = [0], [0]
    stop = time.time() + seconds

    def client(k: int) -> None:
        with httpx.Client(headers=auth, timeout=120) as c:
            i = 0
            while time.time() < stop:
                sid, messages = f"load-{k}-{i}", [{"role": "user", "content": f"{k}{i}="}]
                for turn in range(2):
                    t0 = time.perf_counter()
                    r = c.post(
                        f"{base}/v1/chat/completions",
                        json={**CHAT, "messages": messages, "session_id": sid, "temperature": 1.0},
                    )
                    lat.append(time.perf_counter() - t0)
                    if r.status_code != 200:
                        errors[0] += 1
                        break
                    reply = r.json()["choices"][0]["message"]["content"]
                    messages = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "x="}]
                else:
                    record = c.get(f"{base}/v1/sessions/{sid}").json()
                    if [t["turns"] for t in record["trajectories"]] != [2]:
                        inexact[0] += 1
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    q = statistics.quantiles(lat, n=100)
    return {
        "case": f"load: {clients} clients, {seconds:g} s",
        "status": f"{len(lat)} turns, {errors[0]} errors, {inexact[0]} inexact records",
        "p50_ms": round(1000 * q[49], 1),
        "p99_ms": round(1000 * q[98], 1),
    }


def full_sessions(base: str, auth: dict, pid: int, count: int, n: int, clients: int = 16) -> dict:
    """`count` sessions, each filled to the most the gateway lets one hold: turns of `n` samples
    (each a new segment: the first message is changed) until a turn is refused as
    `session_too_large`. The gateway's resident memory before, at its peak and after, beside the
    bytes it counts (`rlhf_gateway_session_bytes`) and the sessions it still holds."""
    import threading

    import httpx

    def scrape() -> dict[str, float]:
        text = httpx.get(f"{base}/metrics", headers=auth).text
        out = {}
        for line in text.splitlines():
            if line.startswith(("rlhf_gateway_session", "rlhf_gateway_sessions_evicted_total")):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    m0, turns, codes = memory(pid), [0], {}
    lock, next_id = threading.Lock(), iter(range(count))

    def client() -> None:
        with httpx.Client(headers=auth, timeout=300) as c:
            for i in next_id:
                for t in range(10_000):
                    body = {**CHAT, "messages": [{"role": "user", "content": f"{t}="}], "n": n, "max_tokens": 32}
                    r = c.post(f"{base}/v1/chat/completions", json={**body, "session_id": f"full-{i}"})
                    with lock:
                        turns[0] += 1
                    if r.status_code != 200:
                        code = (r.json().get("error") or {}).get("code") if r.status_code < 500 else r.status_code
                        with lock:
                            codes[code] = codes.get(code, 0) + 1
                        break

    t0 = time.time()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    m1 = memory(pid)
    return {
        "case": f"{count} sessions filled to max_session_bytes, n={n} a turn",
        "status": f"{turns[0]} turns in {time.time() - t0:.0f} s; last turns refused: {codes}",
        "rss_before_mb": round(m0["VmRSS"]),
        "hwm_mb": round(m1["VmHWM"]),
        "rss_after_mb": round(m1["VmRSS"]),
        **{k: int(v) for k, v in scrape().items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="runs/tiny-model")
    ap.add_argument("--label", default="probe")
    ap.add_argument("--big-mb", type=float, default=20.0)
    ap.add_argument("--mid-mb", type=float, default=4.0, help="a message under max_request_bytes (8 MiB)")
    ap.add_argument("--many", type=int, default=100, help="requests of the session-id and segment cases")
    ap.add_argument("--load-s", type=float, default=0.0, help="then this many seconds of load (0: none)")
    ap.add_argument("--clients", type=int, default=20, help="clients of the load, each a 2-turn session at a time")
    ap.add_argument("--only-load", action="store_true", help="the load alone, not the cases")
    ap.add_argument("--sessions", type=int, default=0, help="then this many sessions filled to the most allowed")
    ap.add_argument("--samples", type=int, default=8, help="n of each turn of --sessions")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a gateway config override")
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose services run (another tree: a baseline)")
    args = ap.parse_args()

    import httpx

    logs = ROOT / "runs" / "bench" / "probe_gateway"
    logs.mkdir(parents=True, exist_ok=True)
    config = logs / "probe.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"path": str(Path(args.model).resolve()), "device": "cpu"},
                "prompt_length": 64,
                "response_length": 32,
                "rpc": {"auth_token": TOKEN},
            }
        )
    )
    root = Path(args.root).resolve()
    gen, g = start(
        ["serve", "generation", "-c", str(config), "--port", "0", "--metrics-port", "-1"], logs / "gen.log", root
    )
    gw, w = start(
        ["serve", "gateway", "-c", str(config), "--set", f"rpc.generation.port={g['port']}", "--port", "0"]
        + [a for kv in args.set for a in ("--set", kv)],
        logs / "gateway.log",
        root,
    )
    port = int(w["http_port"])
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    results: list[dict] = []

    def case(name: str, r, **extra) -> None:
        if isinstance(r, tuple):  # raw(): (status, head)
            row = {"case": name, "status": r[0], "openai_shape": None, **extra}
        else:
            row = {"case": name, "status": r.status_code, "openai_shape": openai_shape(r), "bytes": len(r.content)}
            row.update(extra)
        results.append(row)
        print(json.dumps(row), flush=True)

    def status(path, body) -> int | str:
        """The status of a POST, or why the client could not read the answer."""
        try:
            return post(path, body).status_code
        except httpx.HTTPError as e:
            return f"client: {e}"

    def post(path, body, headers=auth, client=None, **kw):
        data = json.dumps(body, allow_nan=True).encode() if not isinstance(body, bytes) else body
        h = {"content-type": "application/json", **headers}
        return (client or httpx).post(f"{base}{path}", content=data, headers=h, timeout=600, **kw)

    try:
        assert post("/v1/chat/completions", CHAT).status_code == 200
        if args.load_s:
            results.append(load(base, auth, args.clients, args.load_s))
            print(json.dumps(results[-1]), flush=True)
        if args.sessions:
            results.append(full_sessions(base, auth, gw.pid, args.sessions, args.samples))
            print(json.dumps(results[-1]), flush=True)
        if args.only_load or args.sessions:
            return report(results, args.label)
        nan = {**CHAT, "temperature": math.nan}
        case("temperature NaN, no token", post("/v1/chat/completions", nan, headers={}))
        case("temperature NaN, token", post("/v1/chat/completions", nan))
        case("temperature Infinity, token", post("/v1/chat/completions", {**CHAT, "temperature": math.inf}))
        case("top_p NaN, token", post("/v1/chat/completions", {**CHAT, "top_p": math.nan}))
        post("/v1/chat/completions", {**CHAT, "session_id": "s-reward"})
        case("reward NaN, no token", post("/v1/sessions/s-reward/reward", {"reward": math.nan}, headers={}))
        case("reward NaN, token", post("/v1/sessions/s-reward/reward", {"reward": math.nan}))
        case("seed 2^63", post("/v1/chat/completions", {**CHAT, "seed": 2**63}))
        case("seed -2^63-1", post("/v1/chat/completions", {**CHAT, "seed": -(2**63) - 1}))
        case("completions prompt id 2^31", post("/v1/completions", {"prompt": [1, 2**31], "max_tokens": 2}))
        case("completions prompt id 10^6 (outside vocab)", post("/v1/completions", {"prompt": [1, 10**6]}))
        case("completions prompt id -1", post("/v1/completions", {"prompt": [1, -1], "max_tokens": 2}))
        # the connection after an error: the next request on the same keep-alive connection
        failed = 0
        for _ in range(5):
            with httpx.Client(timeout=60) as c:
                post("/v1/chat/completions", nan, client=c)
                try:
                    c.get(f"{base}/v1/models", headers=auth).raise_for_status()
                except Exception:
                    failed += 1
        results.append({"case": "next request on the connection after an error fails", "status": f"{failed}/5"})
        print(results[-1], flush=True)

        for path in ("/openapi.json", "/docs", "/redoc"):
            case(f"GET {path}, no token", httpx.get(base + path))
            case(f"GET {path}, token", httpx.get(base + path, headers=auth))
        big_field = {"messages": "x" * 1_000_000}
        case("invalid 1 MB body, no token", post("/v1/chat/completions", big_field, headers={}))
        case("validation error, token (messages missing)", post("/v1/chat/completions", {"model": "x"}))
        case("JSON parse error, token", post("/v1/chat/completions", b"{not json"))
        case("GET /nowhere, token", httpx.get(f"{base}/nowhere", headers=auth))
        case("GET /v1/chat/completions (405), token", httpx.get(f"{base}/v1/chat/completions", headers=auth))
        case("unknown session, token", httpx.get(f"{base}/v1/sessions/nope", headers=auth))
        case("n over max, token", post("/v1/chat/completions", {**CHAT, "n": 10**6}))
        case("GET /metrics, no token", httpx.get(f"{base}/metrics"))
        case("GET /metrics, token", httpx.get(f"{base}/metrics", headers=auth))
        case("GET /health", httpx.get(f"{base}/health"))
        chunked = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        ).encode()
        piece = b"x" * 1_048_576
        chunked += b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(12)) + b"0\r\n\r\n"
        case("chunked body of 12 MB of junk, token", raw(port, chunked))
        lying = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000000000\r\n\r\n{"
        ).encode()
        case("Content-Length 100 GB, token", raw(port, lying, timeout=10))

        # memory
        pid = gw.pid
        m0 = memory(pid)
        ids = [{**CHAT, "session_id": f"{i:04d}" + "i" * 1_000_000} for i in range(args.many)]
        codes = [status("/v1/chat/completions", body) for body in ids]
        m1 = memory(pid)
        case(
            f"{args.many} session ids of 1 MB: statuses {sorted(set(map(str, codes)))}",
            httpx.get(f"{base}/health"),
            rss_delta_mb=round(m1["VmRSS"] - m0["VmRSS"], 1),
        )
        junk = {**CHAT, "messages": [{"role": "user", "content": "abc=", "junk": "j" * 1_000_000}]}
        codes = [status("/v1/chat/completions", {**junk, "session_id": "one"}) for _ in range(args.many)]
        m2 = memory(pid)
        case(
            f"{args.many} requests of one session with 1 MB never rendered: statuses {sorted(set(map(str, codes)))}",
            httpx.get(f"{base}/v1/sessions/one", headers=auth),
            rss_delta_mb=round(m2["VmRSS"] - m1["VmRSS"], 1),
        )
        for mb in (args.mid_mb, args.big_mb):
            m2 = memory(pid)
            text = ("the quick brown fox jumps over the lazy dog " * int(mb * 1e6 / 44 + 1))[: int(mb * 1e6)]
            big = {**CHAT, "messages": [{"role": "user", "content": text}]}
            t0 = time.time()
            r = post("/v1/chat/completions", big)
            took = time.time() - t0
            m3 = memory(pid)
            time.sleep(2)
            m4 = memory(pid)
            case(
                f"one {mb:g} MB chat message, token",
                r,
                seconds=round(took, 2),
                rss_before_mb=round(m2["VmRSS"]),
                hwm_before_mb=round(m2["VmHWM"]),
                hwm_after_mb=round(m3["VmHWM"]),
                rss_after_mb=round(m4["VmRSS"]),
            )
        gen.terminate()
        gen.wait(60)
        time.sleep(1)
        case("GET /health, generation server dead", httpx.get(f"{base}/health"))
        case("chat, generation server dead", post("/v1/chat/completions", CHAT))
    finally:
        for p in (gw, gen):
            if p.poll() is None:
                p.terminate()
                p.wait(60)
    report(results, args.label)


def report(results: list[dict], label: str) -> None:
    """Writes runs/bench/probe_gateway-<label>.json and prints the rows as a table."""
    out = ROOT / "runs" / "bench" / f"probe_gateway-{label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print("\n| case | status | OpenAI shape | notes |\n|---|---|---|---|")
    for row in results:
        notes = {k: v for k, v in row.items() if k not in ("case", "status", "openai_shape")}
        print(f"| {row['case']} | {row['status']} | {row.get('openai_shape')} | {notes or ''} |")


if __name__ == "__main__":
    main()
