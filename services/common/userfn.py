"""Your own code, named by reference in a config: `path/to/file.py:fn` (a file, relative to the
current directory or absolute) or `package.module:fn` (importable from the current directory or
sys.path). Reward functions (`reward.rules`), agents (`rollout.agent`) and the pre-flight checks
that load them before a run starts."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from pathlib import Path
from typing import Callable


def is_reference(name: str) -> bool:
    """Whether a rule name points at a function (`file.py:fn` or `module:fn`) rather than a built-in."""
    return ":" in name


def load_function(ref: str, takes: tuple[str, ...] | None = None) -> Callable:
    """The function `ref` names: `path/to/file.py:fn` or `package.module:fn`; with `takes`, one
    whose required parameters are that many (named as `takes` says in the error). ValueError
    saying why not."""
    target, _, attr = ref.rpartition(":")
    if not target or not attr:
        raise ValueError(f"{ref!r}: give 'path/to/file.py:function' or 'module.path:function'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _import_file(ref, Path(target))
    else:
        cwd = os.getcwd()
        if cwd not in sys.path:  # as `python -m` would: modules beside you import under every command
            sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(
                f"{ref!r} cannot be imported: {e} (run from the directory that holds it, give its "
                "file path, or install it)"
            ) from None
        except Exception as e:
            raise ValueError(f"{ref!r}: importing {target} raised {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{ref!r}: {target} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"{ref!r} is not callable")
    if takes is not None:
        required = [p.name for p in inspect.signature(fn).parameters.values() if p.default is inspect.Parameter.empty]
        if len(required) != len(takes):
            raise ValueError(f"{ref!r} takes ({', '.join(required)}); it must take ({', '.join(takes)})")
    return fn


def _import_file(ref: str, path: Path):
    path = path.expanduser()
    if not path.is_file():
        raise ValueError(f"{ref!r}: no such file {path} (relative paths are from the current directory, {os.getcwd()})")
    path = path.resolve()
    name = f"rlhf_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{ref!r}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # the file's own imports of its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(
            f"{ref!r}: loading {path} raised {type(e).__name__}: {e}\n{traceback.format_exc().rstrip()}"
        ) from None
    sys.modules[name] = module
    return module
