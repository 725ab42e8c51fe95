"""Build the tiny default policy offline: a character tokenizer (built with `tokenizers`), a
small Llama-architecture model, and a short supervised warm start on the synthetic task so the
starting policy is imperfect but not random. No model hub is involved.

    rlhf init-model --out runs/tiny-model
"""

from __future__ import annotations

import json
import logging
import string
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..common.model_files import save_model_dir
from ..training.data import sft_examples
from ..training.sources.synthetic import reverse_task

log = logging.getLogger(__name__)

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list(string.ascii_lowercase + string.digits + " =+-*/.,:;!?'\"()[]{}<>_|#\n")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass
class ModelCard:
    """What `rlhf init-model` records about the model it built (model_card.json)."""

    task: str
    vocab_size: int
    warm_start_steps: int
    notes: dict = field(default_factory=dict)

    def write(self, path: Path) -> None:
        (path / "model_card.json").write_text(json.dumps(self.__dict__, indent=2))


def build_tokenizer(size: int | None = None):
    """A character-level tokenizer with <s> prepended, as a transformers fast tokenizer. `size`
    pads its vocabulary with unused tokens (<f0>, <f1>, ...) to that many: a random model with a
    real model's vocabulary size, for memory measurements."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIAL + CHARS
    tokens += [f"<f{i}>" for i in range(max(0, (size or 0) - len(tokens)))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(vocab_size: int, seed: int = 0):
    """A 2-layer Llama (hidden 128, 2 heads of 64): tiny, and a shape vLLM's kernels accept."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    return LlamaForCausalLM(config)


def sft_train(
    model,
    tokenizer,
    examples,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    progress_every: int = 50,
) -> list[float]:
    """Plain next-token training on the answers (prompt tokens are not targets)."""
    from ..common.modeling import response_log_probs
    from ..common.token_batch import build_token_batch

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for step in range(steps):
        idx = torch.randint(len(examples), (batch_size,), generator=g).tolist()
        batch = build_token_batch([examples[i][0] for i in idx], [examples[i][1] for i in idx], tokenizer.pad_token_id)
        lp = response_log_probs(model, batch)["log_probs"]
        loss = -(lp * batch.response_mask).sum() / batch.response_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress_every and (step + 1) % progress_every == 0:
            log.info("warm start step %d/%d  loss %.3f", step + 1, steps, loss.item())
    model.eval()
    return losses


def init_tiny_model(out: str | Path, warm_start_steps: int = 100, seed: int = 0) -> Path:
    """Write tokenizer, config and warm-started weights of the tiny default policy to `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tok = build_tokenizer()
    model = build_model(len(tok), seed)
    records = reverse_task("train", seed=seed)
    losses = sft_train(model, tok, sft_examples(tok, records), warm_start_steps, seed=seed)
    save_model_dir(model, out, tok)
    ModelCard(
        task="synthetic:reverse",
        vocab_size=len(tok),
        warm_start_steps=warm_start_steps,
        notes={
            "final_sft_loss": losses[-1] if losses else None,
            "parameters": sum(p.numel() for p in model.parameters()),
            "build_s": round(time.time() - t0, 2),
        },
    ).write(out)
    log.info(
        "tiny model written to %s (%d parameters, warm start loss %.3f, %.1fs)",
        out,
        sum(p.numel() for p in model.parameters()),
        losses[-1] if losses else float("nan"),
        time.time() - t0,
    )
    return out
