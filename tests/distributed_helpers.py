"""Running a test worker script in 2 processes under torchrun (gloo on the CPU)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: Path, *args: str, nproc: int = 2) -> None:
    """Run `script` with `args` in `nproc` processes; a failure raises with the lines that say why,
    wherever they are in the ranks' output."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(script),
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        why = [
            x
            for x in proc.stderr.splitlines()
            if any(w in x for w in ("Error", "error", "terminate", "abort", "exitcode", "Traceback"))
        ]
        raise AssertionError("\n".join(why[-60:]) + "\n" + proc.stderr[-2000:])
