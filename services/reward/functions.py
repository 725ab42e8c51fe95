"""Your own reward function: found by file path or module, called in whichever of three signatures
it has, checked before a run starts.

Where (a `reward.rules` entry's `name`):
    path/to/reward.py:score     a file, relative to the current directory (or absolute)
    my_pkg.rewards:score        a module importable from the current directory or sys.path

Signatures, told apart by the function's parameter names:
    per sample (this project's)  fn(prompt, response, label, metadata, **kwargs) -> float
    batched (TRL's)              fn(prompts, completions, **columns) -> list[float]
                                 columns: `label` and each metadata field, one value per sample
    verl's                       compute_score(data_source, solution_str, ground_truth, extra_info=None)
                                 -> float, or a dict with a "score"

A label stored as a structure (a dict or list, e.g. verl's `reward_model.ground_truth`) reaches
verl's `ground_truth` and the batched `label` column as it is stored; per-sample functions get
the label string (JSON for a structure). An exception inside the function is a
`RewardFunctionError` carrying its traceback.
"""

from __future__ import annotations

import inspect
import math
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

from ..common.types import STRUCTURED_LABEL, RewardSample
from ..common.userfn import is_reference, load_function

Kind = Literal["sample", "batched", "verl"]


class RewardFunctionError(RuntimeError):
    """A reward function raised (or returned what is not a finite number): its name, the sample,
    and the function's own traceback."""

    def __init__(self, name: str, what: str, tb: str = ""):
        self.name, self.what, self.tb = name, what, tb
        super().__init__(f"reward function {name!r} {what}" + (f"\n{tb.rstrip()}" if tb else ""))


class RuleKwargsError(ValueError):
    """A rule that cannot be called with its `kwargs` (a name it does not take, a value it refuses)."""


def signature_kind(fn: Callable) -> Kind:
    """Which of the three signatures `fn` has, by its parameter names."""
    params = inspect.signature(fn).parameters
    if "solution_str" in params or "ground_truth" in params:
        return "verl"
    if "completions" in params:
        return "batched"
    return "sample"


def check_call(fn: Callable, kind: Kind, kwargs: dict) -> None:
    """ValueError unless `fn` accepts the call its kind makes with the rule's `kwargs`."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: nothing to check
    args: tuple
    if kind == "sample":
        args, named = ("prompt", "response", "label", {}), kwargs
    elif kind == "batched":
        args, named = (), {"prompts": [], "completions": [], **_accepted(sig, {"label": []}), **kwargs}
    else:
        args, named = (
            (),
            {
                "data_source": "",
                "solution_str": "",
                "ground_truth": "",
                **_accepted(sig, {"extra_info": None}),
                **kwargs,
            },
        )
    try:
        sig.bind(*args, **named)
    except TypeError as e:
        expected = {
            "sample": "fn(prompt, response, label, metadata, **kwargs)",
            "batched": "fn(prompts, completions, **columns)",
            "verl": "compute_score(data_source, solution_str, ground_truth, extra_info=None)",
        }[kind]
        raise ValueError(f"cannot be called as {expected} with kwargs {sorted(kwargs)}: {e}") from None


def _accepted(sig: inspect.Signature, values: dict) -> dict:
    """The items of `values` that `sig` takes (all of them with **kwargs)."""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return values
    return {k: v for k, v in values.items() if k in sig.parameters}


@dataclass
class RewardFunction:
    """One rule, built in or yours, called on a batch: `__call__(samples) -> list[float]`. A built-in
    rule's ValueError is its complaint about a sample (a missing label) and passes as it is; any
    exception of yours is a RewardFunctionError."""

    name: str
    fn: Callable
    kind: Kind
    kwargs: dict
    builtin: bool = False
    takes_any: bool = False  # a **kwargs parameter: every column / extra_info is passed
    params: frozenset = frozenset()  # the parameter names it takes

    @classmethod
    def build(cls, name: str, kwargs: dict, builtins: dict[str, Callable]) -> "RewardFunction":
        if name in builtins:
            fn = builtins[name]
        elif is_reference(name):
            fn = load_function(name)
        else:
            raise ValueError(
                f"unknown reward rule {name!r}; built in: {', '.join(sorted(builtins))} (or give "
                "'path/to/file.py:function' or 'module.path:function')"
            )
        kind = signature_kind(fn)
        try:
            check_call(fn, kind, kwargs)
        except ValueError as e:
            raise RuleKwargsError(f"reward rule {name!r} {e}") from None
        if name in builtins:  # pure functions: a trial call shows a bad kwarg value (mode: flexibel)
            try:
                fn("", "0", "0", {}, **kwargs)
            except Exception as e:
                raise RuleKwargsError(f"reward rule {name!r} with kwargs {kwargs}: {e}") from None
        params: Mapping[str, inspect.Parameter]
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a builtin or C function
            params = {}
        return cls(
            name,
            fn,
            kind,
            dict(kwargs),
            builtin=name in builtins,
            params=frozenset(params),
            takes_any=any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()),
        )

    def _takes(self, values: dict) -> dict:
        """The items of `values` this function takes (all of them with **kwargs)."""
        return values if self.takes_any else {k: v for k, v in values.items() if k in self.params}

    def __call__(self, samples: Sequence[RewardSample]) -> list[float]:
        try:
            values = self._call(samples)
        except RewardFunctionError:
            raise
        except ValueError:
            if self.builtin:
                raise
            raise RewardFunctionError(
                self.name, f"raised {traceback.format_exc().rstrip().splitlines()[-1]}", traceback.format_exc()
            ) from None
        except Exception as e:
            raise RewardFunctionError(self.name, f"raised {type(e).__name__}: {e}", traceback.format_exc()) from None
        if self.kind == "batched" and (not isinstance(values, (list, tuple)) or len(values) != len(samples)):
            raise RewardFunctionError(
                self.name,
                f"returned {type(values).__name__} of "
                f"{len(values) if hasattr(values, '__len__') else '?'} values for "
                f"{len(samples)} samples; a batched function returns one float per sample",
            )
        out = []
        for i, v in enumerate(values):
            if isinstance(v, dict):  # verl's {"score": ..., other metrics}
                v = v.get("score")
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise RewardFunctionError(self.name, f"returned {v!r} for sample {i}, not a number") from None
            if not math.isfinite(f):
                raise RewardFunctionError(self.name, f"returned {f} for sample {i}")
            out.append(f)
        return out

    def _call(self, samples: Sequence[RewardSample]) -> list[Any]:
        if self.kind == "sample":
            return [self.fn(s.prompt, s.response, s.label, s.metadata, **self.kwargs) for s in samples]
        if self.kind == "batched":
            columns = {"label": [stored_label(s) for s in samples]}
            for key in dict.fromkeys(k for s in samples for k in s.metadata):
                columns.setdefault(key, [s.metadata.get(key) for s in samples])
            return list(
                self.fn(
                    prompts=[s.prompt for s in samples],
                    completions=[s.response for s in samples],
                    **self._takes(columns),
                    **self.kwargs,
                )
            )
        return [
            self.fn(
                data_source=s.metadata.get("data_source", ""),
                solution_str=s.response,
                ground_truth=stored_label(s),
                **self._takes({"extra_info": s.metadata.get("extra_info")}),
                **self.kwargs,
            )
            for s in samples
        ]


def stored_label(sample: RewardSample) -> Any:
    """The label as the data stored it: a structure where it was one, else the label string."""
    return sample.metadata.get(STRUCTURED_LABEL, sample.label)


def rule_errors(specs, builtins: dict[str, Callable], key: str = "reward.rules") -> list[str]:
    """Every problem of the rules `specs`, one line each naming the entry: an unknown name, a file
    or module that does not import, a function whose signature does not take its kwargs."""
    errors = []
    for i, spec in enumerate(specs or []):
        try:
            RewardFunction.build(spec.name, spec.kwargs, builtins)
        except RuleKwargsError as e:
            errors.append(f"{key}[{i}].kwargs: {e}")
        except ValueError as e:
            errors.append(f"{key}[{i}].name: {e}")
    return errors
