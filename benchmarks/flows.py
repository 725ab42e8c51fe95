#!/usr/bin/env python3
"""How far a reader travels to follow each flow of docs/architecture.md's section 12: the files it
names, its openings (a hop into another file than the one being read: `file.py:Name` names the
file; a bare `Name` is the file it was last named with) and its revisits (an opening of a file
opened before in the same flow). A benchmark: it prints, asserts nothing.

    python3 benchmarks/flows.py [docs/architecture.md]
"""

import re
import sys
from pathlib import Path

text = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/architecture.md").read_text()
sec = text[text.index("## 12. ") :]
flows = re.split(r"\n\*\*(.+?)\*\*\n", sec)[1:]
for title, body in zip(flows[::2], flows[1::2]):
    owner = {}  # class or function name -> file
    seq = []
    for row in body.splitlines():
        if not row.startswith("| ") or row.startswith("| #") or row.startswith("|---"):
            continue
        cell = row.split("|")[3]
        for tok in re.findall(r"`([^`]+)`", cell):
            m = re.match(r"([\w/]+\.py)(?::([\w.]+))?", tok)
            if m:
                f = m.group(1)
                seq.append(f)
                if m.group(2):
                    owner[m.group(2).split(".")[0]] = f
                continue
            name = tok.split("(")[0].split(".")[0]
            if name in owner:
                seq.append(owner[name])
    opened, openings, revisits, cur = set(), 0, 0, None
    for f in seq:
        if f == cur:
            continue
        openings += 1
        revisits += f in opened
        opened.add(f)
        cur = f
    print(f"{title}: {len(opened)} files, {openings} openings, {revisits} revisits")
