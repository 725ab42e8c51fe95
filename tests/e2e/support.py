"""What the end-to-end tests of `rlhf up` share: its command line, the training data file and the
run's progress."""

import json
import sys
from pathlib import Path

from services.training.sources.synthetic import reverse_task


def up_command(config, run_dir, *flags) -> list[str]:
    """`rlhf up -c CONFIG --run-dir RUN_DIR FLAGS...` as an argv, run by this interpreter."""
    return [sys.executable, "-m", "services.cli", "up", "-c", str(config), "--run-dir", str(run_dir), *flags]


def write_train_data(path: Path, n: int, seed: int) -> list:
    """n reverse-task prompts as a .jsonl data file; returns the records."""
    records = reverse_task("train", n, seed=seed)
    path.write_text("".join(json.dumps({"id": r.id, "prompt": r.prompt, "label": r.label}) + "\n" for r in records))
    return records


def run_iterations(run_dir: Path) -> int:
    """The newest iteration in the run's metrics.jsonl (0 before the first)."""
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return 0
    text = p.read_text()
    complete = text[: text.rfind("\n") + 1]  # a row being appended right now is not read half-written
    rows = [json.loads(x) for x in complete.splitlines() if x.strip()]
    return max((r["iteration"] for r in rows), default=0)
