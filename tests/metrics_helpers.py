"""Reading a Prometheus text exposition (a service's /metrics page) in tests."""

import re

SAMPLE_SUFFIXES = ("_bucket", "_count", "_sum")


def parse_exposition(text: str) -> dict[str, dict]:
    """name -> {type, labels (names seen on its samples, without `le`), samples: [(sample name,
    {label: value}, value)]} of a Prometheus text exposition; the `<name>_created` gauges
    prometheus_client adds next to each counter and histogram are left out (docs/metrics.md says so)."""
    families: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^# TYPE (\S+) (\S+)$", line)
        if m:
            current = m.group(1)
            families[current] = {"type": m.group(2), "labels": set(), "samples": []}
            continue
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        assert m, line
        name, labels = m.group(1), dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        assert current and (name == current or name in (current + s for s in SAMPLE_SUFFIXES)), (
            f"sample {name} outside its family ({current})"
        )
        families[current]["samples"].append((name, labels, float(m.group(3))))
        families[current]["labels"] |= set(labels) - {"le"}
    for name in [n for n in families if n.endswith("_created")]:
        stem = name[: -len("_created")]
        if (
            families.get(stem + "_total", {}).get("type") == "counter"
            or families.get(stem, {}).get("type") == "histogram"
        ):
            del families[name]
    return families
