"""Distill a drafter for a target: a small draft model, an MTP head, Medusa heads or an
EAGLE-3 head, trained to match the frozen target's next-token distribution
(KL(target || drafter)) on text.

Training is resumable: a checkpoint (weights, optimizer state, step) is written every
`checkpoint_every` steps and on Ctrl-C; batches are a pure function of (seed, step), so a resumed
run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from mlx_spec.core.compat import copy_tokenizer_files, scored_vocab
from mlx_spec.drafters.medusa import (
    save_medusa_heads,
)
from mlx_spec.drafters.mtp import save_mtp_drafter
from mlx_spec.models.dflash import save_dflash
from mlx_spec.models.eagle3 import save_eagle3
from mlx_spec.training.chat_data import ChatData
from mlx_spec.training.config import DistillConfig
from mlx_spec.training.data import (
    TokenData,
    encode_files,
    generate_tokens,
    target_text,
    text_files,
)
from mlx_spec.training.distiller import CHECKPOINT, Distiller, train
from mlx_spec.training.students import build_student, drafter_for, target_text_config
from mlx_spec.training.teacher import TeacherCache, windows_of

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config, save_model

DATA_CACHE = ".distill-data.npz"
BEFORE = ".distill-before.json"  # the untrained drafter's scores, kept for a resumed run


TEACHER_CACHE = ".distill-teacher"
HELDOUT_WINDOWS = 4  # held-out batches the KL is measured on


def write_drafter(
    out: Path, distiller: Distiller, student_cfg: dict, target_dir: Path, report: dict
) -> None:
    """Write the drafter directory `mlx-spec generate` loads (atomically)."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if distiller.config.kind == "draft-model":
        save_model(tmp, distiller.student)
        save_config(dict(student_cfg), config_path=tmp / "config.json")
        copy_tokenizer_files(target_dir, tmp)
    elif distiller.config.kind == "medusa":
        save_medusa_heads(distiller.student, tmp)
    elif distiller.config.kind == "eagle3":
        student = distiller.student
        weights = dict(tree_flatten(student.parameters()))
        if student.target_ids is not None:  # draft index i drafts target id i + d2t[i]
            size = student.cfg.draft_vocab_size
            weights["d2t"] = student.target_ids - mx.arange(size, dtype=mx.int32)
        save_eagle3(tmp, student.cfg, weights, mx.float32)
    elif distiller.config.kind == "dflash":
        student = distiller.student
        save_dflash(tmp, student.cfg, dict(tree_flatten(student.parameters())), mx.float32)
    else:
        save_mtp_drafter(tmp, distiller.student, student_cfg)
    (tmp / "distill.json").write_text(json.dumps(report, indent=2))
    keep = {CHECKPOINT, DATA_CACHE, BEFORE, TEACHER_CACHE, "answers.jsonl"}
    if out.exists():
        for child in out.iterdir():
            if child.name not in keep:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    for child in tmp.iterdir():
        child.rename(out / child.name)
    tmp.rmdir()


def heldout_acceptance(
    target,
    tokenizer,
    drafter,
    prompts: list[list[int]],
    temperature: float,
    k: int = 4,
    max_tokens: int = 32,
) -> tuple[float, float]:
    """(acceptance rate, acceptance at the first draft position) of `drafter` over held-out
    prompts (seeded, so repeatable)."""
    from mlx_spec.api import generate
    from mlx_spec.core.stats import merge_stats

    runs = []
    for i, prompt in enumerate(prompts):
        stats = generate(
            target,
            tokenizer,
            prompt,
            drafter=drafter,
            num_draft=k,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=i,
        ).stats
        runs.append(stats)
    total = merge_stats(runs)
    first = total.acceptance_by_position[:1]
    return total.acceptance_rate, first[0] if first else 0.0


def measure(distiller: Distiller, tokenizer, heldout: TokenData, teacher: TeacherCache) -> dict:
    """Held-out KL and acceptance (greedy and temperature 1) of the student as it stands."""
    drafter = drafter_for(distiller, tokenizer)
    prompts = heldout.prompts(8, 32)
    report = {"heldout_kl": distiller.evaluate(teacher, distiller.config.batch_size)}
    for name, temperature in (("greedy", 0.0), ("t1", 1.0)):
        rate, first = heldout_acceptance(distiller.target, tokenizer, drafter, prompts, temperature)
        report[f"acceptance_{name}"] = rate
        report[f"acceptance_first_{name}"] = first
    return report


def prepare_data(
    target,
    tokenizer,
    out_dir: Path,
    data_paths,
    holdout_paths,
    generate: int,
    seed: int,
    target_tokens: int = 0,
    target_batch: int = 16,
    chat: ChatData | None = None,
) -> tuple[TokenData, TokenData]:
    """Training and held-out tokens, cached in `out_dir` so a resumed run uses the same ones.

    With `chat`, the target's answers to chat prompts (each with its prompt, through the chat
    template; the last tenth of the prompts held out). Otherwise without data paths the target
    writes `generate` tokens itself; without held-out paths the last tenth of the training
    tokens is held out (and never trained on). With data paths and `target_tokens`, the
    target's own continuations of windows of the training data are added.
    """
    cache = out_dir / DATA_CACHE
    if cache.exists():
        saved = np.load(cache)
        return TokenData(saved["train"], seed), TokenData(saved["heldout"], seed)
    if chat is not None:
        train, heldout = chat.tokens(target, tokenizer, seed)
    else:
        if data_paths:
            train = encode_files(text_files(data_paths), tokenizer)
        else:
            train = generate_tokens(target, tokenizer, generate, seed)
        if holdout_paths:
            heldout = encode_files(text_files(holdout_paths), tokenizer)
        else:
            cut = int(train.size * 0.9)
            train, heldout = train[:cut], train[cut:]
    if data_paths and target_tokens > 0:
        vocab = scored_vocab(target, tokenizer)
        own = target_text(target, train, target_tokens, seed, tokenizer, vocab, target_batch)
        train = np.concatenate([train, own])
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez(cache, train=train, heldout=heldout)
    return TokenData(train, seed), TokenData(heldout, seed)


def _teachers(distiller: Distiller, target, tokenizer, data, heldout, folder: Path):
    """The teacher caches (in `folder`) of the training windows (at most as many as the steps
    will read, or more where the folder already holds them: a drafter trained with fewer steps
    shares another's folder) and of the held-out windows."""
    config = distiller.config
    vocab = scored_vocab(target, tokenizer)
    seq = config.seq_len

    def cache(name: str, windows: np.ndarray) -> TeacherCache:
        return TeacherCache(folder / name, windows, distiller.layers, vocab)

    train = cache("train", windows_of(data.tokens, seq, most=config.steps * config.batch_size))
    kept = TeacherCache.windows_kept(folder / "train")
    if kept is not None and kept > len(train.windows):
        more = cache("train", windows_of(data.tokens, seq, most=kept))
        train = more if more.made_here() else train
    held = windows_of(heldout.tokens, min(seq, heldout.tokens.size))
    held = held[: HELDOUT_WINDOWS * config.batch_size]
    return train, cache("heldout", held)


def run_distill(
    target_dir: str,
    out: str,
    config: DistillConfig,
    *,
    data_paths: tuple = (),
    holdout_paths: tuple = (),
    generate: int = 50_000,
    target_tokens: int = 0,
    target_batch: int = 16,
    init: str | None = None,
    progress: bool = True,
    force: bool = False,
    chat: ChatData | None = None,
    draft_vocab: int | None = None,
    teacher_cache: str | None = None,
    teacher_layers: tuple[int, ...] = (),
) -> dict:
    """Distill a drafter for the target at `target_dir` into `out`; returns the report.

    Resumes from `out`'s checkpoint when one exists; writes the drafter directory (loadable by
    `mlx-spec generate --draft-model OUT` or `--mtp OUT`) and `distill.json` at the end.

    Args:
        target_tokens: with `data_paths`, also train on about this many tokens of the target's
            own continuations of windows of the data (half greedy, half sampled).
        target_batch: rows the target continues at once while writing them.
        init: a drafter directory to train further instead of starting from scratch.
        chat: train on the target's answers to chat prompts instead.
        draft_vocab: EAGLE-3 only: the head's output vocabulary, the most frequent target
            tokens of the training text (None: the whole vocabulary).
        teacher_cache: where the teacher's answers are kept (default: inside `out`, removed
            at the end); a folder shared by drafters trained on the same text and settings
            is computed once.
        teacher_layers: also keep these target layers' features in it (Hugging Face
            `hidden_states` ids; L: the final state), for another drafter that will read them.
    """
    from mlx_spec.core.paths import SOURCE_ATTR
    from mlx_spec.loading import load

    out_dir = Path(out)
    checkpoint = out_dir / CHECKPOINT
    working = {CHECKPOINT, DATA_CACHE, BEFORE, TEACHER_CACHE, "answers.jsonl"}
    other = [p for p in out_dir.iterdir() if p.name not in working] if out_dir.exists() else []
    if other and not checkpoint.exists() and not force:
        raise ValueError(
            f"{out}: already exists and holds no unfinished run to resume "
            "(use --force to overwrite it)"
        )
    target, tokenizer = load(target_dir)
    target_dir = str(getattr(target, SOURCE_ATTR, target_dir))  # a short name or hub id: its folder
    data, heldout = prepare_data(
        target,
        tokenizer,
        out_dir,
        data_paths,
        holdout_paths,
        generate,
        config.seed,
        target_tokens,
        target_batch,
        chat,
    )
    counts = None
    if draft_vocab is not None:
        counts = np.bincount(data.tokens, minlength=scored_vocab(target, tokenizer))
    student, student_cfg = build_student(
        target, target_text_config(Path(target_dir)), config, None if init is None else Path(init),
        counts=counts, draft_vocab=draft_vocab,
    )  # fmt: skip
    distiller = Distiller(target, student, config)
    folder = Path(teacher_cache) if teacher_cache else out_dir / TEACHER_CACHE
    teacher, heldout_teacher = _teachers(distiller, target, tokenizer, data, heldout, folder)
    teacher.fill(target, progress, also=teacher_layers)
    heldout_teacher.fill(target, progress, also=teacher_layers)
    tic = time.perf_counter()
    before_file = out_dir / BEFORE
    if checkpoint.exists():  # resumed: the first run measured the untrained drafter
        before = json.loads(before_file.read_text()) if before_file.is_file() else None
    else:
        before = measure(distiller, tokenizer, heldout, heldout_teacher)
        out_dir.mkdir(parents=True, exist_ok=True)
        before_file.write_text(json.dumps(before))
    steps = train(distiller, teacher, checkpoint, progress)
    after = measure(distiller, tokenizer, heldout, heldout_teacher)
    report = {
        "kind": config.kind,
        "steps": steps,
        "config": asdict(config),
        "train_tokens": len(data),
        "heldout_tokens": len(heldout),
        "target_tokens": target_tokens,
        "target_batch": target_batch,
        "init": init,
        "seconds": time.perf_counter() - tic,
        "before": before,
        "after": after,
    }
    write_drafter(out_dir, distiller, student_cfg, Path(target_dir), report)
    shutil.rmtree(checkpoint, ignore_errors=True)
    if not teacher_cache:
        shutil.rmtree(out_dir / TEACHER_CACHE, ignore_errors=True)
    (out_dir / DATA_CACHE).unlink(missing_ok=True)
    before_file.unlink(missing_ok=True)
    return report
