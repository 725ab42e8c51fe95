"""Model and tokenizer directories: where a model is (a local directory, or a hub snapshot when
one can be had), loading and saving one, and the device it runs on. The forward passes are
modeling.py; the batches they take, token_batch.py."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# what a hub model is fetched with: config, tokenizer, chat template and safetensors weights
HUB_MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def check_model_dir(path: str | Path) -> Path:
    """The local directory of the model `path`: `path` itself when it holds config.json; for a hub
    id (`name` or `org/name` that is not a local path) the snapshot directory huggingface_hub
    resolves it to, from its cache or by downloading (unless HF_HUB_OFFLINE is set)."""
    text = str(path)
    p = Path(text).expanduser()
    if (p / "config.json").exists():
        return p
    if text.startswith(("/", ".", "~")) or p.exists() or text.count("/") > 1:
        raise FileNotFoundError(
            f"no model at {p} (config.json missing: {_missing_model_reason(p)}); {build_hint(p)}, or set model.path "
            "to a model directory or a hub id (org/name)"
        )
    return _hub_snapshot(text)


def build_hint(p: str | Path) -> str:
    """How to build a model at `p` offline: the tiny default, or SmolLM2 (what `make smollm2` does)."""
    return (
        f"build one with `rlhf init-model --out {p}` (the tiny default) or `rlhf init-model --from-gguf smollm2 "
        f"--out {p}` (SmolLM2-135M-Instruct, as `make smollm2` does)"
    )


def _missing_model_reason(p: Path) -> str:
    """Why the local path `p` is no model directory, in a few words."""
    if p.is_file():
        return "it is a file, not a directory"
    if not p.exists():
        parent = next((a for a in p.parents if a.exists()), None)
        return (
            "the directory does not exist"
            if parent is None or parent.is_dir()
            else f"{parent} is a file, not a directory"
        )
    try:
        names = sorted(c.name for c in p.iterdir())
    except OSError as e:
        return f"the directory cannot be read: {e.strerror}"
    if not names:
        return "the directory is empty"
    shown = ", ".join(names[:5]) + (f", ... ({len(names)} entries)" if len(names) > 5 else "")
    return f"the directory holds only {shown}"


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        snapshot = Path(snapshot_download(repo_id, allow_patterns=HUB_MODEL_FILES))
    except (OSError, ValueError) as e:
        reason = str(e).split("\n")[0]
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local directory nor reachable on the Hugging Face hub (no network "
            f"or not cached: {type(e).__name__}: {reason}); pre-download it into the hub cache (HF_HOME), or give "
            f"a local directory (`rlhf init-model --out DIR` builds the tiny default)"
        ) from e
    if not (snapshot / "config.json").exists():
        raise FileNotFoundError(f"model {repo_id!r} on the Hugging Face hub has no config.json ({snapshot})")
    return snapshot


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(check_model_dir(path)))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def save_model_dir(model, path: str | Path, tokenizer=None, **kwargs) -> None:
    """`model` (and `tokenizer`) as a Hugging Face directory at `path`, every file readable as the
    umask allows: safetensors writes its file 0600 (through a temporary file), which other users
    and containers running as another uid could not read. `kwargs` go to `save_pretrained`."""
    path = Path(path)
    model.save_pretrained(str(path), **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    umask = os.umask(0)
    os.umask(umask)
    for f in path.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def load_causal_lm(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model: nn.Module = AutoModelForCausalLM.from_pretrained(str(check_model_dir(path)), dtype=dtype)
    return model.to(device)


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of the model directory `path` (those its index names, or the one
    model.safetensors); [] when it has none."""
    import json

    path = Path(path)
    index = path / "model.safetensors.index.json"
    names = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    return [path / n for n in names if (path / n).is_file()]


def read_state(path: str | Path, names: set[str], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor] | None:
    """The tensors `names` of the causal LM at `path` (its state dict's names), read from its
    safetensors files one by one as `dtype`, nothing else loaded; a tensor the model ties to
    another (an unembedding that is the embedding) is read under whichever name the files hold.
    None when the files do not hold them all (another format)."""
    from safetensors import safe_open

    if not names:
        return {}
    path = check_model_dir(path)
    with torch.device("meta"):
        model = empty_causal_lm(path)
    first: dict[int, str] = {}
    tied = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    found: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            held = set(f.keys())
            for name in names - found.keys():
                stored = next((n for n in (name, tied.get(name, name)) if n in held), None)
                if stored is not None:
                    found[name] = f.get_tensor(stored).to(dtype)
    return found if len(found) == len(names) else None


def state_names(path: str | Path) -> set[str]:
    """The names of the state dict of the causal LM at `path`, from its architecture alone."""
    with torch.device("meta"):
        return set(empty_causal_lm(path).state_dict())


def empty_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32):
    """The architecture `load_causal_lm` loads, without its weights: built under the caller's
    default device (the meta device: no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(check_model_dir(path)))
    return AutoModelForCausalLM.from_config(config, dtype=dtype)
