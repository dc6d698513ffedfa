"""Training text a chat model writes itself: its answers to chat prompts, each prompt rendered
with the model's chat template, written by the batch engine and kept in a JSON-lines file so an
interrupted run resumes where it stopped (and several distillations share one set)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: JSON lines with a "prompt" field, or one prompt per line."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: not a JSON prompt ({exc})") from None
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids of a one-turn conversation asking `prompt`, ready for the answer."""
    from mlx_spec.serving.chat import chat_prompt

    text = chat_prompt(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer.encode(text, add_special_tokens=False))


def _done(path: Path) -> dict[tuple[int, float], dict]:
    done = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by an interruption
                continue
            done[(record["index"], record["temperature"])] = record
    return done


def write_answers(
    model,
    tokenizer,
    prompts: Sequence[str],
    path: str | Path,
    *,
    temperatures: Sequence[float] = (0.0,),
    max_tokens: int = 256,
    batch: int = 32,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """The model's answer to every prompt at every temperature, in `path` (JSON lines:
    index, temperature, prompt_ids, answer_ids, finish_reason); answers already there are kept.
    Returns the records in (prompt, temperature) order."""
    from mlx_spec.core.compat import scored_vocab
    from mlx_spec.core.sampling import SamplingConfig
    from mlx_spec.decoding.engine import BatchEngine, BatchRequest

    from tqdm import tqdm

    path = Path(path)
    done = _done(path)
    jobs = [(i, t) for i in range(len(prompts)) for t in temperatures if (i, t) not in done]
    if jobs:
        engine = BatchEngine(model, tokenizer, scored_vocab(model, tokenizer), {}, max_batch=batch)
        bar = tqdm(total=len(jobs), desc="answers", unit="answer", disable=not progress,
                   file=sys.stderr)  # fmt: skip
        with path.open("a") as out:
            for index, temperature in jobs:
                ids = prompt_ids(tokenizer, prompts[index])
                record = {"index": index, "temperature": temperature, "prompt_ids": ids}
                engine.add(
                    BatchRequest(
                        prompt=ids,
                        sampling=SamplingConfig(temperature=temperature),
                        max_tokens=max_tokens,
                        emit=_collector(record, out, done, bar),
                        seed=seed + 7919 * index,
                    )
                )
            while engine.busy:
                engine.step()
        bar.close()
    return [done[(i, t)] for i in range(len(prompts)) for t in temperatures]


def _collector(record: dict, out, done: dict, bar):
    tokens: list[int] = []

    def emit(chunk) -> None:
        if isinstance(chunk, BaseException):
            raise chunk
        if chunk.token is not None:
            tokens.append(chunk.token)
            return
        record.update(answer_ids=tokens, finish_reason=chunk.finish_reason)
        out.write(json.dumps(record) + "\n")
        out.flush()
        done[(record["index"], record["temperature"])] = record
        bar.update(1)

    return emit


def answer_tokens(records: Sequence[dict], eos: int | None) -> np.ndarray:
    """Every record's prompt and answer joined (EOS after an answer the model ended), as one
    token array."""
    pieces = []
    for record in records:
        end = [eos] if eos is not None and record.get("finish_reason") == "stop" else []
        pieces.append(np.asarray(record["prompt_ids"] + record["answer_ids"] + end, np.int32))
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)


@dataclass(frozen=True)
class ChatData:
    """Train on the target's own answers to chat prompts.

    Attributes:
        prompts: file of prompts (JSON lines with "prompt", or one per line).
        answers: JSON-lines file the answers are kept in (several runs can share it).
        temperatures: each prompt is answered once at each.
        max_tokens: tokens per answer at most.
        batch: answers written at once.
    """

    prompts: str
    answers: str
    temperatures: tuple[float, ...] = (0.0, 0.7)
    max_tokens: int = 256
    batch: int = 32

    def tokens(self, target, tokenizer, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(training tokens, held-out tokens): the answers to the first nine tenths of the
        prompts, and to the rest."""
        from mlx_spec.training.chat_data import answer_tokens, read_prompts, write_answers

        prompts = read_prompts(self.prompts)
        records = write_answers(
            target, tokenizer, prompts, self.answers, temperatures=self.temperatures,
            max_tokens=self.max_tokens, batch=self.batch, seed=seed,
        )  # fmt: skip
        cut = max(1, int(len(prompts) * 0.9))
        eos = sorted(tokenizer.eos_token_ids)[0] if tokenizer.eos_token_ids else None
        train = answer_tokens([r for r in records if r["index"] < cut], eos)
        heldout = answer_tokens([r for r in records if r["index"] >= cut], eos)
        return train, heldout
