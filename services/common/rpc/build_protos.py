"""Generate the Python gRPC stubs in `services/common/rpc/gen/` from `proto/rlhf/v1/*.proto`.

    python -m services.common.rpc.build_protos          # write the stubs
    python -m services.common.rpc.build_protos --check  # exit 1 if the committed stubs differ

protoc writes absolute imports (`from rlhf.v1 import common_pb2`); they are rewritten to
relative ones so the stubs live inside this package. Never edit the generated files by hand.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent / "gen"


def generate(out_dir: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted((PROTO_DIR / "rlhf" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p.relative_to(PROTO_DIR)) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for f in sorted((Path(tmp) / "rlhf" / "v1").iterdir()):
            text = re.sub(r"^from rlhf\.v1 import", "from . import", f.read_text(), flags=re.M)
            (out_dir / f.name).write_text(text)
            written.append(out_dir / f.name)
        (out_dir / "__init__.py").write_text('"""Generated from proto/rlhf/v1 by build_protos.py; do not edit."""\n')
        return written


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if not args.check:
        for p in generate(OUT_DIR):
            print(p.relative_to(ROOT))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_text() for p in generate(Path(tmp))}
    stale = [n for n, t in fresh.items() if not (OUT_DIR / n).exists() or (OUT_DIR / n).read_text() != t]
    if stale:
        print(f"stubs out of date: {', '.join(stale)}; run python -m services.common.rpc.build_protos")
        return 1
    print("stubs match proto/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
