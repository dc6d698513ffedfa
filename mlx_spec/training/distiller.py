"""Training steps against the cached teacher, checkpoints, and the resumable training loop."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from mlx_spec.models.dflash import train_logits, training_anchors
from mlx_spec.models.mtp import target_layers
from mlx_spec.training.config import DistillConfig
from mlx_spec.training.teacher import TeacherCache, TopK, kl_to_teacher

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

CHECKPOINT = ".distill-checkpoint"
TTT_STEPS = 3  # EAGLE-3: drafting steps unrolled in training


class Distiller:
    """Trains a student to match a frozen target's cached answers (`TeacherCache`)."""

    def __init__(self, target: nn.Module, student: nn.Module, config: DistillConfig):
        self.target, self.student, self.config = target, student, config
        # the target layers whose features the student reads (L: the final normed state)
        self.layers: tuple[int, ...] = ()
        if config.kind in ("mtp", "medusa"):
            self.layers = (len(target_layers(target)),)
        elif config.kind == "eagle3":
            self.layers = tuple(student.cfg.layer_ids)
        elif config.kind == "dflash":
            self.layers = tuple(student.hidden_layers)
        ids = getattr(student, "target_ids", None) if config.kind == "eagle3" else None
        self.t2d = None  # target id -> draft index, for a head over a reduced vocabulary
        if ids is not None:
            t2d = np.full(student.cfg.vocab_size, -1, np.int32)
            t2d[np.array(ids)] = np.arange(ids.size, dtype=np.int32)
            self.t2d = mx.array(t2d)
        self.target.freeze()
        warmup = max(1, config.steps // 20)
        schedule = optim.join_schedules(
            [
                optim.linear_schedule(1e-7, config.learning_rate, warmup),
                optim.cosine_decay(config.learning_rate, max(1, config.steps - warmup)),
            ],
            [warmup],
        )
        self.optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
        self._grad = nn.value_and_grad(student, self._loss)

    def _kl(self, teacher: TopK, logits: mx.array) -> mx.array:
        return kl_to_teacher(teacher, logits, self.t2d)

    def _loss(
        self, tokens: mx.array, teacher: TopK, hidden: mx.array | None, unroll: bool = True
    ) -> mx.array:
        """The training loss (`unroll=False`: the first drafting step alone, the held-out KL
        every kind reports alike)."""
        if self.config.kind == "draft-model":
            return self._kl(teacher, self.student(tokens))
        if self.config.kind == "dflash":
            # Draft i of the block at a guesses the token at a + i: the target's
            # distribution for it is at a + i - 1.
            logits = train_logits(self.student, tokens, hidden)
            block = self.student.cfg.block_size
            starts = training_anchors(tokens.shape[1], block)
            rows = mx.array([[a + i for i in range(block - 1)] for a in starts])
            return self._kl(teacher[:, rows], logits)
        if self.config.kind == "medusa":
            # Head k reads h_p and guesses t_{p+2+k}, whose target distribution is at p+1+k.
            logits = self.student(hidden)  # [K, B, S, V]
            losses = [
                self._kl(teacher[:, k + 1 :], logits[k, :, : -(k + 1)])
                for k in range(logits.shape[0])
            ]
            return mx.stack(losses).mean()
        # MTP and EAGLE-3: the pair (h_p, t_{p+1}) (h: the layers' features for EAGLE-3)
        # predicts t_{p+2}, whose target distribution is at p+1.
        logits = self._student(tokens[:, 1:], hidden[:, :-1])
        loss = self._kl(teacher[:, 1:], logits)
        if self.config.kind != "eagle3" or not unroll:
            return loss
        # EAGLE-3's training-time test: step i + 1 feeds back step i's outputs, as drafting
        # does (here every position is self-fed: the sequence-wide approximation), the
        # pair (y_p, t_{p+i+1}) guessing t_{p+i+2}; the steps weigh 0.8 ** i.
        total, weight = loss, 1.0
        for step in range(1, TTT_STEPS):
            fed = self.student.feedback[:, :-1]
            logits = self._student(tokens[:, step + 1 :], fed)
            weight *= 0.8
            total = total + weight * self._kl(teacher[:, step + 1 :], logits)
        return total

    def _student(self, tokens: mx.array, hidden: mx.array) -> mx.array:
        if self.t2d is not None:  # the head's own (draft vocabulary) logits
            return self.student(tokens, cache=[None], hidden=hidden, full=False)
        return self.student(tokens, cache=[None], hidden=hidden)

    def step(self, batch: tuple) -> float:
        """One optimizer step on a batch of (tokens, teacher, features)."""
        loss, grads = self._grad(*batch)
        self.optimizer.update(self.student, grads)
        mx.eval(loss, self.student.parameters(), self.optimizer.state)
        return loss.item()

    def evaluate(self, teacher: TeacherCache, batch_size: int) -> float:
        """Mean KL(target || student) on the held-out windows (over the teacher's top K)."""
        losses = []
        for start in range(0, len(teacher.windows), batch_size):
            indices = np.arange(start, min(start + batch_size, len(teacher.windows)))
            losses.append(self._loss(*teacher.batch(indices), unroll=False).item())
        return float(np.mean(losses)) if losses else float("nan")


def batch_indices(step: int, windows: int, batch_size: int, seed: int) -> np.ndarray:
    """The windows of training step `step`: a function of (seed, step) alone, so a resumed run
    sees exactly the batches an uninterrupted one would."""
    return np.random.default_rng((seed, 0, step)).integers(0, windows, size=batch_size)


def save_checkpoint(path: Path, distiller: Distiller, step: int) -> None:
    """Weights, optimizer state and step, written to a temp dir and renamed."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(
        str(tmp / "student.safetensors"), dict(tree_flatten(distiller.student.parameters()))
    )
    state = dict(tree_flatten(distiller.optimizer.state))
    mx.save_safetensors(
        str(tmp / "optimizer.safetensors"),
        {k: v for k, v in state.items() if isinstance(v, mx.array)},
    )
    meta = {"step": step, "config": asdict(distiller.config)}
    (tmp / "state.json").write_text(json.dumps(meta))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def load_checkpoint(path: Path, distiller: Distiller) -> int:
    """Restore weights and optimizer state; returns the step to continue from."""
    meta = json.loads((path / "state.json").read_text())
    if meta["config"] != asdict(distiller.config):
        raise ValueError(f"{path}: checkpoint was made with other settings; use a new --out")
    distiller.student.load_weights(str(path / "student.safetensors"))
    distiller.optimizer.init(distiller.student.trainable_parameters())
    saved = mx.load(str(path / "optimizer.safetensors"))
    distiller.optimizer.state = tree_unflatten(list(saved.items()))
    return meta["step"]


def train(
    distiller: Distiller, teacher: TeacherCache, checkpoint: Path, progress: bool = True
) -> int:
    """Run (or resume) training to `config.steps` on the cached teacher's windows; returns the
    steps done in total."""
    config = distiller.config
    start = load_checkpoint(checkpoint, distiller) if (checkpoint / "state.json").exists() else 0
    bar = tqdm(total=config.steps, initial=start, desc="distill", disable=not progress, unit="step")
    step, tic = start, time.perf_counter()
    try:
        while step < config.steps:
            indices = batch_indices(step, len(teacher.windows), config.batch_size, config.seed)
            loss = distiller.step(teacher.batch(indices))
            step += 1
            rate = config.batch_size * config.seq_len * (step - start) / (time.perf_counter() - tic)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:.0f}")
            bar.update(1)
            if step % config.checkpoint_every == 0 or step == config.steps:
                save_checkpoint(checkpoint, distiller, step)
    except KeyboardInterrupt:
        save_checkpoint(checkpoint, distiller, step)  # nothing lost: resume continues here
        raise
    finally:
        bar.close()
    return step
