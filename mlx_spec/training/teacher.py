"""What the frozen target says about each training window, computed once and kept on disk:
its K likeliest next tokens with their log-probabilities at every position, and the features
a drafter reads (final hidden states or several layers' inputs).

Running the target inside every training step cost most of a step (on a 2-core CPU a
135M-parameter target's pass over 8 x 128 tokens took seconds); with the teacher's answers
cached a step runs the drafter alone. Chunks are written as they are computed, so an
interrupted run resumes where it stopped. Training matches the teacher on its top K tokens
(`kl_to_teacher`): the KL over the tokens the target gives mass to, the rest being negligible
for drafting.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

TOP_K = 64
CHUNK = 8  # windows per target pass (and per file)


@dataclass
class TopK:
    """The teacher's K likeliest tokens at each position: ids `[..., K]`, log-probs `[..., K]`."""

    ids: mx.array
    logprobs: mx.array

    def __getitem__(self, index) -> TopK:
        return TopK(self.ids[index], self.logprobs[index])


def kl_to_teacher(teacher: TopK, student_logits: mx.array, t2d: mx.array | None = None):
    """Mean over positions of sum_i p_i (log p_i - log q_i) over the teacher's top-K tokens.

    Args:
        teacher: `[..., K]` ids and log-probabilities.
        student_logits: `[..., V]` over the target vocabulary, or over a draft vocabulary.
        t2d: `[target vocab]` draft index of each target id (-1: not in the draft vocabulary);
            teacher tokens outside the draft vocabulary are left out.
    """
    student = student_logits.astype(mx.float32)
    student = student - mx.logsumexp(student, axis=-1, keepdims=True)
    ids, keep = teacher.ids, None
    if t2d is not None:
        ids = t2d[ids]
        keep = ids >= 0
        ids = mx.maximum(ids, 0)
    picked = mx.take_along_axis(student, ids, axis=-1)
    terms = mx.exp(teacher.logprobs) * (teacher.logprobs - picked)
    if keep is not None:
        terms = mx.where(keep, terms, 0.0)
    return terms.sum(-1).mean()


def _digest(windows: np.ndarray, spec: dict) -> str:
    digest = hashlib.sha256(np.ascontiguousarray(windows).tobytes())
    digest.update(json.dumps(spec, sort_keys=True).encode())
    return digest.hexdigest()[:16]


class TeacherCache:
    """The teacher's answers for `windows` (`[W, S]` token ids), in `folder`: its top K at
    every position and the features of `layers` (Hugging Face `hidden_states` ids; L is the
    final normed state). Several drafters trained on the same windows can share a folder: a
    run that needs layers the folder lacks computes it again with all of them.

    Args:
        folder: where the chunks live (cleared if they were made for other windows).
        windows: the token windows the teacher reads (each is its own context).
        layers: the layers whose features are kept (empty: none).
        vocab: logits are cut to the tokenizer's vocabulary (padded rows never count).
    """

    def __init__(self, folder: Path, windows: np.ndarray, layers: tuple[int, ...], vocab: int):
        self.folder, self.windows, self.vocab = Path(folder), windows, vocab
        self.layers = tuple(layers)
        self.key = _digest(windows, {"vocab": vocab, "top_k": TOP_K})
        self.ids = self.logprobs = None
        self.hidden: dict[int, np.ndarray] = {}

    def _chunk(self, index: int) -> Path:
        return self.folder / f"chunk-{index:05d}.npz"

    def _kept(self) -> tuple[int, ...] | None:
        """The layers the folder's chunks keep, if they were made for these windows."""
        meta = self.folder / "teacher.json"
        if not meta.is_file():
            return None
        saved = json.loads(meta.read_text())
        return tuple(saved["layers"]) if saved.get("key") == self.key else None

    @staticmethod
    def windows_kept(folder: Path) -> int | None:
        """How many windows the chunks in `folder` were made for (None: none there)."""
        try:
            return int(json.loads((Path(folder) / "teacher.json").read_text())["windows"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def made_here(self) -> bool:
        """Whether the folder's chunks were made for these windows."""
        return self._kept() is not None

    def fill(self, target, progress: bool = True, also: tuple[int, ...] = ()) -> None:
        """Compute the chunks not on disk yet (a progress bar shows them), keeping the features
        of `also` too (for another drafter that will share the folder), then load them."""
        from mlx_spec.caches.taps import tap_layers

        from tqdm import tqdm

        kept = self._kept()
        wanted = set(self.layers) | set(also)
        if kept is None or not wanted <= set(kept):
            layers = tuple(sorted(wanted | set(kept or ())))
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir(parents=True)
            meta = {"key": self.key, "layers": list(layers), "windows": len(self.windows)}
            (self.folder / "teacher.json").write_text(json.dumps(meta))
            kept = layers
        tap = tap_layers(target, kept) if kept else None
        chunks = range(-(-len(self.windows) // CHUNK))
        missing = [c for c in chunks if not self._chunk(c).is_file()]
        for c in tqdm(missing, desc="teacher", unit="chunk", disable=not progress or not missing,
                      file=sys.stderr):  # fmt: skip
            self._compute(c, target, tap, kept)
        parts = [np.load(self._chunk(c)) for c in chunks]
        self.ids = np.concatenate([p["ids"] for p in parts])
        self.logprobs = np.concatenate([p["logprobs"] for p in parts])
        self.hidden = {i: np.concatenate([p[f"layer_{i}"] for p in parts]) for i in self.layers}

    def _compute(self, c: int, target, tap, layers: tuple[int, ...]) -> None:
        tokens = mx.array(self.windows[c * CHUNK : (c + 1) * CHUNK])
        logits = target(tokens)[..., : self.vocab].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        k = min(TOP_K, self.vocab)
        ids = mx.argpartition(-logprobs, k - 1, axis=-1)[..., :k]
        arrays = {
            "ids": ids.astype(mx.int32),
            "logprobs": mx.take_along_axis(logprobs, ids, axis=-1).astype(mx.float16),
        }
        if layers:
            width = tap.hidden.shape[-1] // len(layers)
            for n, i in enumerate(layers):
                arrays[f"layer_{i}"] = tap.hidden[..., n * width : (n + 1) * width]
        arrays = {name: value.astype(mx.float16) if name.startswith("layer_") else value
                  for name, value in arrays.items()}  # fmt: skip
        mx.eval(arrays)
        tmp = self._chunk(c).with_suffix(".partial.npz")
        np.savez(tmp, **{name: np.array(value) for name, value in arrays.items()})
        tmp.rename(self._chunk(c))

    def batch(self, indices: np.ndarray) -> tuple[mx.array, TopK, mx.array | None]:
        """(tokens `[B, S]`, the teacher's top K `[B, S, K]`, the layers' features concatenated
        in the order asked `[B, S, F]` or None) of the windows at `indices`."""
        tokens = mx.array(self.windows[indices])
        teacher = TopK(
            mx.array(self.ids[indices]), mx.array(self.logprobs[indices]).astype(mx.float32)
        )
        if not self.layers:
            return tokens, teacher, None
        parts = [self.hidden[i][indices] for i in self.layers]
        hidden = mx.array(np.concatenate(parts, axis=-1)).astype(mx.float32)
        return tokens, teacher, hidden


def windows_of(tokens: np.ndarray, seq_len: int, most: int | None = None) -> np.ndarray:
    """`[W, seq_len]`: consecutive windows of `tokens`; with `most`, at most that many, evenly
    spaced over the text."""
    count = tokens.size // seq_len
    if count == 0:
        raise ValueError(
            f"{tokens.size} tokens of text is too little for windows of {seq_len}; give more "
            "text or a smaller --seq-len"
        )
    windows = tokens[: count * seq_len].reshape(count, seq_len)
    if most is not None and count > most:
        windows = windows[np.linspace(0, count - 1, most).round().astype(int)]
    return np.ascontiguousarray(windows, np.int32)
