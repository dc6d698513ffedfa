"""EAGLE-3 drafting: the head runs on features of several target layers, as an MTP head runs on
the final hidden states (the same pairs (g_p, t_{p+1}), the same rollback of self-fed steps).

The target runner records the layers the head names (`hidden_layers`); every other part of the
decode loop is the MTP drafter's. The head's distribution is zero outside its draft
vocabulary (its logits there are -inf), so rejection sampling stays exact: q is what the
draft was sampled from.
"""

from __future__ import annotations

from pathlib import Path

from mlx_spec.caches.taps import decoder_layers
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.models.eagle3 import Eagle3Head, build_eagle3

import mlx.nn as nn

EAGLE_DIR = "eagle3"


class Eagle3Drafter(MTPDrafter):
    """Drafts with an EAGLE-3 head bound to its target model.

    Args:
        head: the `Eagle3Head`, built on `target`.
        target: the model whose layers' features (and embedding) it reads.
    """

    name = "eagle3"
    needs_hidden = True

    def __init__(self, head: Eagle3Head, target: nn.Module):
        super().__init__(head, target)
        self.hidden_layers = head.cfg.layer_ids

    def check_compatible(self, target: nn.Module, tokenizer, vocab_size: int) -> None:
        if target is not self.target:
            raise ValueError("this EAGLE-3 drafter was loaded for another target model")
        layers = len(decoder_layers(target))
        if max(self.hidden_layers) > layers:
            raise ValueError(
                f"the EAGLE-3 head reads target layers {list(self.hidden_layers)}; the target "
                f"has {layers}"
            )


def locate_eagle3(path: Path) -> Path:
    """The head's directory: `path`, or `path/eagle3` beside a converted target."""
    return path / EAGLE_DIR if (path / EAGLE_DIR / "config.json").is_file() else path


def load_eagle3_drafter(path: str | Path, target: nn.Module) -> Eagle3Drafter:
    """Load an EAGLE-3 head (the EAGLE repository's layout, the speculators format, or one
    converted by `mlx-spec convert`) for `target`.

    Raises:
        ValueError: the head does not fit the target (the message names what differs).
    """
    return Eagle3Drafter(build_eagle3(locate_eagle3(Path(path)), target), target)
