"""The benchmark's prompts: the held-out files or a prompts file, checked against the models."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlx_spec import embedded
from mlx_spec.api import encode_prompt
from mlx_spec.bench.config import BenchConfig, longest_draft


@dataclass
class Prompt:
    """One benchmark prompt: a label (file name or line number) and its token ids."""

    label: str
    ids: list[int]


def read_prompts_file(path: str | Path) -> list[tuple[str, str]]:
    """(label, text) of each prompt in a file: one per line, or JSON lines whose objects have a
    "prompt" string (the format is JSON lines when the first non-blank line starts with "{").
    Blank lines are skipped; `\\n` in a plain line stays literal.

    Raises:
        FileNotFoundError: no such file.
        ValueError: no prompts, or a JSON line that is not an object with a "prompt" string.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such prompts file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason})") from exc
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise ValueError(f"{path}: no prompts (the file is empty)")
    if not numbered[0][1].lstrip().startswith("{"):
        return [(f"line {n}", line) for n, line in numbered]
    return [(f"line {n}", _json_prompt(path, n, line)) for n, line in numbered]


def _json_prompt(path: Path, n: int, line: str) -> str:
    """The "prompt" string of JSON line `n`."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from exc
    text = record.get("prompt") if isinstance(record, dict) else None
    if not isinstance(text, str) or not text:
        raise ValueError(f'{path}:{n}: expected an object with a non-empty "prompt" string')
    return text


def builtin_prompts(tokenizer, num_tokens: int) -> list[Prompt]:
    """The first `num_tokens` tokens of each held-out standard-library file."""
    out = []
    for path in embedded.stdlib_files()[1]:
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            ids = encode_prompt(tokenizer, text[: 32 * num_tokens])  # a token is < 32 characters
            if len(ids) < num_tokens and len(text) > 32 * num_tokens:
                ids = encode_prompt(tokenizer, text)
            out.append(Prompt(path.name, ids[:num_tokens]))
    if not out:
        raise FileNotFoundError("none of the held-out standard-library files exist here")
    return out


def load_prompts(config: BenchConfig, tokenizer, vocab: int, limits: list[int]) -> list[Prompt]:
    """The run's prompts, each checked to fit every model's context and the vocabulary."""
    if config.prompts_file is None:
        prompts = builtin_prompts(tokenizer, config.prompt_tokens)
    else:
        prompts = [
            Prompt(label, encode_prompt(tokenizer, text))
            for label, text in read_prompts_file(config.prompts_file)
        ]
    prompts = prompts[: config.num_prompts]
    room = min(limits) if limits else None
    for p in prompts:
        _check_prompt(config, p, vocab, room)
    return prompts


def _check_prompt(config: BenchConfig, p: Prompt, vocab: int, room: int | None) -> None:
    if room is not None and len(p.ids) + config.max_tokens + longest_draft(config) >= room:
        raise ValueError(
            f"prompt {p.label} has {len(p.ids)} tokens: with max_tokens "
            f"{config.max_tokens} it does not fit the context of {room} tokens"
        )
    bad = next((t for t in p.ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt {p.label}: token id {bad} is outside the vocabulary")
