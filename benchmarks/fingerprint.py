"""What a refactor must leave unchanged, as one JSON document: the sha256 of `final/`'s weights and
the metrics (wall-clock keys left out) of `train --local` and `rlhf up` on the tiny default, and the
sha256 of every HTTP surface's OpenAPI schema (the gateway's, the reward server's).

    .venv/bin/python benchmarks/fingerprint.py --out /tmp/before.json      # on the old commit
    .venv/bin/python benchmarks/fingerprint.py --out /tmp/after.json       # on the new one
    .venv/bin/python benchmarks/fingerprint.py --compare /tmp/before.json /tmp/after.json

It runs `--iterations` iterations of each (3 by default: about 2 minutes on 2 cores) in a fresh
run directory under runs/fingerprint/, with the run's seed fixed; a metric that depends on time
(seconds, tokens per second, timestamps) is dropped before comparing."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RLHF = [sys.executable, "-m", "services.cli"]
TIMED = ("time", "_s", "/s", "seconds", "tok_s", "tokens_per_s", "wall", "elapsed", "mem", "rss", "pss", "_at")


def _untimed(row: dict) -> dict:
    return {k: v for k, v in sorted(row.items()) if not any(t in k for t in TIMED)}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(mode: str, iterations: int, model: str) -> dict:
    run_dir = ROOT / "runs" / "fingerprint" / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = ["train", "--local"] if mode == "local" else ["up"]
    sets = [f"run.iterations={iterations}", f"model.path={model}", "run.eval_interval=2"]
    args = [*RLHF, *cmd, "-c", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    weights = sorted((run_dir / "final").glob("*.safetensors"))
    metrics = [_untimed(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {"final": {p.name: _sha(p) for p in weights}, "metrics": metrics}


def schemas(model: str) -> dict:
    """The OpenAPI schema of each HTTP app, built in this process as the services build them."""
    code = (
        "import json, hashlib, sys\n"
        "from tests.http_helpers import openapi_schemas\n"
        f"texts = openapi_schemas({model!r})\n"
        "print(json.dumps({k: hashlib.sha256(v.encode()).hexdigest() for k, v in texts.items()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(a: dict, b: dict) -> int:
    diffs = 0
    for key in sorted(set(a) | set(b)):
        same = a.get(key) == b.get(key)
        diffs += not same
        print(f"{key:10s} {'same' if same else 'DIFFERENT'}")
    return 1 if diffs else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--model", default="runs/tiny-model")
    ap.add_argument("--compare", nargs=2)
    a = ap.parse_args()
    if a.compare:
        return compare(*(json.loads(Path(p).read_text()) for p in a.compare))
    doc = {"local": run("local", a.iterations, a.model), "up": run("up", a.iterations, a.model)}
    doc["openapi"] = schemas(a.model)
    text = json.dumps(doc, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(json.dumps({"local": doc["local"]["final"], "up": doc["up"]["final"], "openapi": doc["openapi"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
