"""DFlash drafting: a block of drafts in one pass of the draft stack.

The drafter's cache holds only the context (each layer's K/V of the target's projected
features, one entry per committed position); the block's own K/V are never stored, so a
rejection has nothing to roll back. The features of the positions a round commits (the old
pending token and the accepted drafts) arrive with `accept` and join the cache when the next
block is drafted. Each draft position has its own distribution (the block is drafted at once,
not one token after another), which is the q the verifier divides by.
"""

from __future__ import annotations

from pathlib import Path

from mlx_spec.caches.taps import decoder_layers
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.drafters.base import Draft, Drafter, unique_id
from mlx_spec.drafters.draft_model import CATCH_UP, pick_token
from mlx_spec.models.dflash import DFlashModel, build_dflash

import mlx.core as mx
import mlx.nn as nn

DFLASH_DIR = "dflash"


class DFlashDrafter(Drafter):
    """Drafts a block with a DFlash stack bound to its target.

    Args:
        model: the `DFlashModel`, built on `target`.
        target: the model whose layers' features, embedding and head it uses.
    """

    name = "dflash"
    needs_hidden = True

    def __init__(self, model: DFlashModel, target: nn.Module):
        self.model, self.target = model, target
        self.hidden_layers = model.hidden_layers
        self.max_depth = model.cfg.block_size - 1
        self.caches = None
        self._queued: list[mx.array] = []  # features of committed positions not yet cached
        self.pending: int | None = None
        self.position = 0  # the pending token's position
        self.vocab_size = 0

    @property
    def identity(self):
        return (self.name, unique_id(self.model))

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches) if self.caches else 0

    def check_compatible(self, target: nn.Module, tokenizer, vocab_size: int) -> None:
        if target is not self.target:
            raise ValueError("this DFlash drafter was loaded for another target model")

    def available(self, k: int) -> int | None:
        return min(k, self.max_depth)

    def begin(self, prompt: list[int], vocab_size: int, hidden: mx.array | None = None) -> None:
        self.caches = self.model.make_cache()
        self._queued = [] if hidden is None or not hidden.shape[0] else [hidden]
        self.pending, self.position, self.vocab_size = prompt[-1], len(prompt) - 1, vocab_size

    def catch_up(self) -> None:
        """Cache the context that piled up over plain steps, so that the next block pays for
        drafting only (a few positions ride along with it)."""
        if sum(h.shape[0] for h in self._queued) < CATCH_UP or self.caches is None:
            return
        self.model.feed_context(mx.concatenate(self._queued)[None], self.caches)
        self._queued = []
        mx.eval([c.state for c in self.caches])

    def draft(self, k: int, sampling: SamplingConfig) -> Draft:
        k = min(k, self.max_depth)
        if k <= 0:
            return Draft.empty()
        features = mx.concatenate(self._queued)[None] if self._queued else None
        self._queued = []
        block = mx.array([[self.pending] + [self.model.cfg.mask_token_id] * k], mx.uint32)
        logits = self.model(block, features, self.caches, self.position)[0, :, : self.vocab_size]
        if sampling.greedy:
            return Draft(mx.argmax(logits, axis=-1).astype(mx.uint32))
        tokens, probs = zip(*(pick_token(row, sampling) for row in logits), strict=True)
        return Draft(mx.stack(tokens).astype(mx.uint32), mx.stack(probs))

    def accept(self, num_accepted: int, emitted: list[int], hidden: mx.array | None = None) -> None:
        if hidden is not None and hidden.shape[0]:
            self._queued.append(hidden)
        self.position += len(emitted)
        self.pending = emitted[-1]


def locate_dflash(path: Path) -> Path:
    return path / DFLASH_DIR if (path / DFLASH_DIR / "config.json").is_file() else path


def load_dflash_drafter(path: str | Path, target: nn.Module) -> DFlashDrafter:
    """Load a DFlash drafter (z-lab's layout, the speculators format, or converted by
    `mlx-spec convert`) for `target`.

    Raises:
        ValueError: it does not fit the target (the message names what differs).
    """
    where = locate_dflash(Path(path))
    model = build_dflash(where, target)
    depth = len(decoder_layers(target))
    if max(model.cfg.target_layer_ids) >= depth:
        raise ValueError(f"{where}: the DFlash drafter reads layers past the target's {depth}")
    return DFlashDrafter(model, target)
