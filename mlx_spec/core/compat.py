"""Draft/target compatibility: the same tokenizer, compared token by token."""

from __future__ import annotations

import shutil
import weakref
from pathlib import Path

import mlx.nn as nn

# Tokenizer and generation settings that travel with a model's weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tiktoken.model",
    "qwen.tiktoken",
)


def copy_tokenizer_files(source: Path, dest: Path) -> list[str]:
    """Copy the tokenizer and generation files `source` has into `dest`; returns their names."""
    names = [n for n in TOKENIZER_FILES if (source / n).is_file()]
    for name in names:
        shutil.copy(source / name, dest / name)
    return names


def tokenizer_vocab(tokenizer) -> dict[str, int]:
    """Token text -> id, added tokens included, for an mlx-lm TokenizerWrapper or HF tokenizer."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    return inner.get_vocab()


_VOCAB_SIZES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocab_size(tokenizer) -> int:
    """Number of ids the tokenizer can produce (embedding rows beyond it are padding)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return _VOCAB_SIZES[inner]
    except (KeyError, TypeError):
        size = max(tokenizer_vocab(tokenizer).values()) + 1
    try:
        _VOCAB_SIZES[inner] = size  # computed once per tokenizer: 150k-entry vocabularies are slow
    except TypeError:
        pass
    return size


def output_rows(model: nn.Module) -> int | None:
    """Rows of the model's output head from its config, when it declares them."""
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        rows = (
            source.get("vocab_size")
            if isinstance(source, dict)
            else getattr(source, "vocab_size", None)
        )
        if isinstance(rows, int):
            return rows
    return None


def scored_vocab(model: nn.Module, tokenizer) -> int:
    """Ids that can be generated: the tokenizer's, cut to the model's head when that is smaller."""
    rows = output_rows(model)
    return min(vocab_size(tokenizer), rows) if rows is not None else vocab_size(tokenizer)


def check_model_covers_vocab(model: nn.Module, needed: int, role: str) -> None:
    """Refuse a model whose head scores fewer than `needed` tokens."""
    rows = output_rows(model)
    if rows is not None and rows < needed:
        raise ValueError(
            f"{role} model scores {rows} tokens but the target generates {needed}; "
            "the two models do not share a vocabulary"
        )


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """Raise ValueError naming the first differences if the two vocabularies are not identical.

    Embedding matrices padded beyond the vocabulary (e.g. 151936 vs 152064 rows) are fine: only
    token texts and ids are compared.
    """
    target, draft = tokenizer_vocab(target_tokenizer), tokenizer_vocab(draft_tokenizer)
    if target == draft:
        return
    diffs = [
        f"{text!r}: target id {target.get(text)}, draft id {draft.get(text)}"
        for text in sorted(set(target) | set(draft), key=lambda t: (target.get(t, -1), t))
        if target.get(text) != draft.get(text)
    ]
    raise ValueError(
        f"draft and target tokenizers differ ({len(target)} vs {len(draft)} tokens, "
        f"{len(diffs)} differences, e.g. " + "; ".join(diffs[:3]) + "); "
        "speculative decoding needs a drafter with the target's tokenizer"
    )
