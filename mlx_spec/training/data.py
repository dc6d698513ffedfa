"""Token data for distillation: text files or folders, or text the target writes itself."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx
import numpy as np

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".c", ".h", ".js", ".ts", ".rs", ".go")


def text_files(paths: Iterable[str | Path]) -> list[Path]:
    """Files named, and text files under folders named, sorted; refuses paths that don't exist."""
    out = []
    for path in map(Path, paths):
        if path.is_dir():
            out += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            out.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    return out


def encode_files(files: list[Path], tokenizer) -> np.ndarray:
    """All files tokenized and joined, each followed by EOS (when the tokenizer has one)."""
    eos = sorted(tokenizer.eos_token_ids)[:1]
    ids: list[int] = []
    for path in files:
        ids += tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False) + eos
    return np.asarray(ids, np.int32)


def generate_tokens(
    model, tokenizer, count: int, seed: int, chunk: int = 256, batch_size: int = 16
) -> np.ndarray:
    """`count` tokens sampled from the target at temperature 1 (its own text to learn from):
    rows of up to `chunk` tokens from BOS, `batch_size` at a time, each cut at its first EOS and
    ended by one."""
    from mlx_spec.core.compat import scored_vocab

    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
    eos_ids = sorted(tokenizer.eos_token_ids)
    vocab = scored_vocab(model, tokenizer)
    ids: list[int] = []
    while len(ids) < count:
        starts = np.full((batch_size, 1), start, np.int32)
        rows = continue_windows(model, starts, chunk, 1.0, seed + len(ids), vocab, batch_size)
        for row in rows.tolist():
            end = next((i for i, token in enumerate(row) if token in eos_ids), len(row))
            ids += row[:end] + eos_ids[:1]
    return np.asarray(ids[:count], np.int32)


def continue_windows(
    model,
    windows: np.ndarray,
    new_tokens: int,
    temperature: float,
    seed: int,
    vocab_size: int,
    batch_size: int = 16,
) -> np.ndarray:
    """The target's own continuations of `windows` (`[N, P]` token ids): `[N, new_tokens]` ids,
    greedy (`temperature` 0) or sampled, generated `batch_size` rows at a time."""
    from mlx_spec.core.sampling import SamplingConfig, pick

    from mlx_lm.models.cache import make_prompt_cache

    sampling = SamplingConfig(temperature=temperature)
    mx.random.seed(seed)
    out = []
    for start in range(0, len(windows), batch_size):
        cache = make_prompt_cache(model)
        tokens = mx.array(windows[start : start + batch_size])  # [B, P]
        rows = []
        for _ in range(new_tokens):
            logits = model(tokens, cache=cache)[:, -1, :vocab_size]  # [B, vocab]
            tokens = pick(logits, sampling)[:, None]
            mx.async_eval(tokens)
            rows.append(tokens)
        out.append(np.array(mx.concatenate(rows, axis=1)))
    return np.concatenate(out) if out else np.zeros((0, new_tokens), np.int32)


def target_text(
    model,
    data: np.ndarray,
    count: int,
    seed: int,
    tokenizer,
    vocab_size: int,
    batch_size: int = 16,
    prompt_len: int = 64,
) -> np.ndarray:
    """About `count` tokens of the target's own text to train on: windows of `data`, each
    followed by the target's continuation (half greedy, half sampled at temperature 1) and EOS
    (when the tokenizer has one), joined."""
    new = 4 * prompt_len
    rows = max(2, -(-count // (prompt_len + new)))
    rng = np.random.default_rng((seed, 7))
    starts = rng.integers(0, max(1, data.size - prompt_len), size=rows)
    windows = np.stack([data[s : s + prompt_len] for s in starts]).astype(np.int32)
    half = rows // 2
    continued = np.concatenate(
        [
            continue_windows(model, windows[:half], new, 0.0, seed, vocab_size, batch_size),
            continue_windows(model, windows[half:], new, 1.0, seed + 1, vocab_size, batch_size),
        ]
    )
    eos = sorted(tokenizer.eos_token_ids)[:1]
    pieces = [np.concatenate([w, c, eos]) for w, c in zip(windows, continued, strict=True)]
    return np.concatenate(pieces).astype(np.int32)


class TokenData:
    """A token array from which batch `step` is always the same windows (resumable)."""

    def __init__(self, tokens: np.ndarray, seed: int = 0):
        self.tokens = tokens
        self.seed = seed

    def __len__(self) -> int:
        return int(self.tokens.size)

    def batch(self, step: int, batch_size: int, seq_len: int, stream: int = 0) -> mx.array:
        """`[batch_size, seq_len]` windows at offsets drawn from (seed, stream, step)."""
        span = self.tokens.size - seq_len
        if span <= 0:
            raise ValueError(
                f"{self.tokens.size} tokens of text is too little for windows of "
                f"{seq_len}; give more text or a smaller --seq-len"
            )
        rng = np.random.default_rng((self.seed, stream, step))
        starts = rng.integers(0, span + 1, size=batch_size)
        return mx.array(np.stack([self.tokens[s : s + seq_len] for s in starts]))

    def fixed_batches(self, count: int, batch_size: int, seq_len: int) -> list[mx.array]:
        """Evaluation batches, the same every call."""
        return [self.batch(i, batch_size, seq_len, stream=1) for i in range(count)]

    def prompts(self, count: int, length: int) -> list[list[int]]:
        """Evenly spaced prompts for measuring acceptance."""
        if self.tokens.size < 2 * length:
            return [self.tokens.tolist()[:length]] if self.tokens.size else []
        starts = np.linspace(0, self.tokens.size - 2 * length, count).astype(int)
        return [self.tokens[s : s + length].tolist() for s in starts]
