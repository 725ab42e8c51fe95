"""Hugging Face `datasets` sources: `hf:NAME[:CONFIG][@SPLIT]` (a hub dataset, or a local dataset
directory: a name that starts with '/', './', '../' or '~', or an existing directory) and a
`.parquet`, `.csv` or `.json` file. The default split is the one asked for; an `hf:` source without
one takes the first of `SPLIT_CHOICES` it has (eval: eval, test, validation, valid)."""

from __future__ import annotations

from pathlib import Path

from .kind import SourceKind, missing

DATASETS_FILE_TYPES = (".parquet", ".csv", ".json")
# the dataset splits `hf:` sources fall back to, in order, when the wanted split is missing
SPLIT_CHOICES = {"train": ("train",), "eval": ("eval", "test", "validation", "valid")}


def matches(source: str) -> bool:
    return source.startswith("hf:") or source.endswith(DATASETS_FILE_TYPES)


def problem(source: str) -> str | None:
    """A local file or dataset directory that does not exist; hub dataset names are not checked."""
    if source.startswith("hf:"):
        local = _local_dataset_dir(_parse_hf(source)[0])
        return missing(str(local), "dataset directory") if local is not None else None
    return missing(source)


def _parse_hf(source: str) -> tuple[str, str | None, str | None]:
    """`hf:<name>[:<config>][@<split>]` -> (name, config, split)."""
    spec, _, split = source[3:].partition("@")
    name, _, config = spec.partition(":")
    return name, config or None, split or None


def _local_dataset_dir(name: str) -> Path | None:
    """`name` as a local directory when it looks like one: it starts with '/', './', '../' or '~', or
    is an existing directory. None for anything else (a hub dataset name)."""
    path = Path(name).expanduser()
    return path if name.startswith(("/", "./", "../", "~")) or path.is_dir() else None


def rows(source: str, split: str, limit: int | None) -> list[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data source {source!r} needs the `datasets` package: pip install datasets") from None
    if source.startswith("hf:"):
        name, config, want_split = _parse_hf(source)
        local = _local_dataset_dir(name)
        name = name if local is None else str(local)
        candidates = (want_split,) if want_split else SPLIT_CHOICES.get(split, (split,))
        if local is not None and (local / "dataset_dict.json").exists():  # written by DatasetDict.save_to_disk
            splits = datasets.load_from_disk(name)
            ds = splits[_pick_split(source, candidates, list(splits))]
        else:
            if want_split is None:
                want_split = _pick_split(source, candidates, datasets.get_dataset_split_names(name, config))
            ds = datasets.load_dataset(name, config, split=want_split)
    else:
        name, want_split = source, split
        if not Path(name).exists():
            raise FileNotFoundError(f"data file {name} does not exist")
        ds = datasets.load_dataset(Path(name).suffix.lstrip("."), data_files={want_split: name}, split=want_split)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    label = Path(name).name
    return [(f"{label}:{i}", dict(row)) for i, row in enumerate(ds)]


def _pick_split(source: str, candidates: tuple[str, ...], available: list[str]) -> str:
    """The first of `candidates` that the dataset has."""
    for name in candidates:
        if name in available:
            return name
    base = source.partition("@")[0]
    raise ValueError(
        f"{source} has no {'/'.join(candidates)} split (it has {', '.join(available)}); "
        f"choose one with {base}@<split>, e.g. {base}@{available[0]}"
    )


KIND = SourceKind("datasets", "hf:NAME[:CONFIG][@SPLIT] or FILE.parquet|.csv|.json", matches, problem, rows=rows)
