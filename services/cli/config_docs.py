"""The configuration described for people: every key with its default, options and meaning
(`rlhf config describe`), and the README's configuration table generated from it.

    python -m services.cli.config_docs            print the table
    python -m services.cli.config_docs --readme   rewrite README.md's table
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel

from ..common.config import Config


def describe_config(fmt: str = "markdown") -> str:
    """Every leaf key of the configuration, one row each: its dotted key (`reward.rules[].name` for
    the fields of a list's items), default, options (a Literal's choices or a number's bounds) and
    description; a markdown table (`fmt="markdown"`) or an aligned plain-text one (`fmt="text"`)."""
    header = ("key", "default", "options", "meaning")
    rows = _rows(Config, Config().model_dump(mode="json"), "")
    if fmt == "markdown":
        lines = [header, ("---",) * 4, *rows]
        return "".join("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |\n" for row in lines)
    if fmt == "text":
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
        return "".join("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[3]]).rstrip() + "\n"
                       for row in [header, *rows])
    raise ValueError(f"unknown format {fmt!r}; valid: markdown, text")


def _rows(model: type[BaseModel], defaults: dict | None, prefix: str) -> list[tuple[str, str, str, str]]:
    """The rows of `model`'s fields under `prefix`, recursing into sections; `defaults` holds the
    dumped default values (None: take each field's own default)."""
    rows = []
    for name, field in model.model_fields.items():
        key, annotation = prefix + name, field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += _rows(annotation, defaults[name] if defaults is not None else None, key + ".")
            continue
        if defaults is not None:
            default = _yaml_value(defaults[name])
        elif field.is_required():
            default = "required"
        else:
            default = _yaml_value(field.get_default(call_default_factory=True))
        rows.append((key, default, _options(annotation, field.metadata), field.description or ""))
        item = get_args(annotation)[0] if get_origin(annotation) is list else None
        if isinstance(item, type) and issubclass(item, BaseModel):
            rows += _rows(item, None, key + "[].")
    return rows


def _yaml_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000).removesuffix("...\n").strip()


def _options(annotation: Any, metadata: list) -> str:
    """A Literal's choices (with null when Optional), else the bounds of a number: [0, 1], > 0, ..."""
    args = get_args(annotation)
    nullable = type(None) in args
    literal = next((a for a in (annotation, *args) if get_origin(a) is Literal), None)
    if literal is not None:
        return ", ".join([*map(str, get_args(literal)), *(["null"] if nullable else [])])
    b = {k: getattr(m, k) for m in metadata for k in ("ge", "gt", "le", "lt", "min_length") if hasattr(m, k)}
    low = ("[", b["ge"]) if "ge" in b else ("(", b["gt"]) if "gt" in b else None
    high = (b["le"], "]") if "le" in b else (b["lt"], ")") if "lt" in b else None
    if low and high:
        bounds = f"{low[0]}{low[1]}, {high[0]}{high[1]}"
    elif low:
        bounds = f"{'>=' if low[0] == '[' else '>'} {low[1]}"
    elif high:
        bounds = f"{'<=' if high[1] == ']' else '<'} {high[0]}"
    elif "min_length" in b:
        bounds = f"length >= {b['min_length']}"
    else:
        return ""
    return f"{bounds} or null" if nullable else bounds


README = Path(__file__).resolve().parents[2] / "README.md"
TABLE_START, TABLE_END = "<!-- config-table:start -->", "<!-- config-table:end -->"


def readme_with_config_table(text: str) -> str:
    """`text` with what lies between the config-table markers replaced by describe_config("markdown")."""
    head, start, rest = text.partition(TABLE_START)
    _, end, tail = rest.partition(TABLE_END)
    if not (start and end):
        raise ValueError(f"no {TABLE_START} ... {TABLE_END} block")
    return f"{head}{TABLE_START}\n{describe_config('markdown')}{TABLE_END}{tail}"


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(prog="python -m services.cli.config_docs",
                                     description="print every configuration key, or rewrite README.md's table")
    parser.add_argument("--readme", action="store_true", help=f"rewrite the configuration table in {README}")
    if parser.parse_args().readme:
        README.write_text(readme_with_config_table(README.read_text()))
        print(f"wrote the configuration table into {README}")
    else:
        print(describe_config("text"), end="")
