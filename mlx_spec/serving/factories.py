"""The drafters a server offers: a factory of fresh drafters (and their batched form) each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlx_spec.core.compat import scored_vocab
from mlx_spec.decoding import distributed
from mlx_spec.decoding.engine import ALL
from mlx_spec.drafters.base import Drafter, hidden_layer_ids
from mlx_spec.drafters.batch import (
    BatchDFlash,
    BatchDrafter,
    BatchDraftModel,
    BatchEagle3,
    BatchMTP,
    BatchNgram,
)
from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.drafters.group import DrafterGroup
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.drafters.ngram import NgramDrafter

import mlx.nn as nn

# The drafters that read the target's features: only the first offered joins "all".
FEATURE_READERS = ("mtp", "eagle3", "dflash")


@dataclass
class DrafterFactory:
    """Makes a fresh drafter per request (`__call__`), and, where the drafter can run inside
    the batch engine, its batched form (`batch`)."""

    make: Callable[[], Drafter]
    batch: Callable[[], BatchDrafter] | None = None

    def __call__(self) -> Drafter:
        return self.make()


def ngram_drafter() -> Drafter:
    return NgramDrafter()


def ngram_factory() -> DrafterFactory:
    """n-gram lookup, which every server offers."""
    return DrafterFactory(ngram_drafter, BatchNgram)


def drafter_factories(
    model: nn.Module,
    tokenizer,
    *,
    draft_model: str | None = None,
    mtp: str | None = None,
    assistant: str | None = None,
    eagle: str | None = None,
    dflash: str | None = None,
) -> dict[str, Callable[[], Drafter]]:
    """{drafter name: factory of a fresh drafter}: weights are loaded (and checked against the
    target) once, and every request gets its own drafter state over them.

    Args:
        model, tokenizer: the target.
        draft_model: a draft model directory or hub id.
        mtp: an MTP drafter directory, or the converted target directory holding `mtp/`.
        assistant: a Gemma 4 assistant directory.
        eagle: an EAGLE-3 head directory.
        dflash: a DFlash drafter directory.
    Returns:
        One factory per drafter given (n-gram lookup always), and "all": a `DrafterGroup` of
        them, when there are two or more.
    """
    vocab = scored_vocab(model, tokenizer)
    out: dict[str, DrafterFactory] = {"ngram": ngram_factory()}
    if draft_model is not None:
        out["draft-model"] = draft_model_factory(draft_model, model, tokenizer, vocab)
    if mtp is not None:
        out["mtp"] = mtp_factory(mtp, model)
    if assistant is not None:
        out["gemma4-assistant"] = assistant_factory(assistant, model, tokenizer, vocab)
    if eagle is not None:
        out["eagle3"] = eagle_factory(eagle, model)
    if dflash is not None:
        out["dflash"] = dflash_factory(dflash, model)
    if len(out) > 1:  # every drafter at once: the policy picks one each round
        out[ALL] = group_factory(out)
    return out


def draft_model_factory(path: str, model, tokenizer, vocab: int) -> DrafterFactory:
    from mlx_spec.loading import load

    small, small_tok = load(path)
    DraftModelDrafter(small, small_tok).check_compatible(model, tokenizer, vocab)
    return DrafterFactory(
        lambda: DraftModelDrafter(small, small_tok), lambda: BatchDraftModel(small)
    )


def mtp_factory(path: str, model) -> DrafterFactory:
    from mlx_spec.loading import load_mtp_drafter

    head = load_mtp_drafter(path, model)
    return DrafterFactory(lambda: MTPDrafter(head.module, model), lambda: BatchMTP(head.module))


def assistant_factory(path: str, model, tokenizer, vocab: int) -> DrafterFactory:
    from mlx_spec.drafters.gemma4_assistant import (
        Gemma4AssistantDrafter,
        load_gemma4_assistant,
    )

    loaded = load_gemma4_assistant(path, model)
    loaded.check_compatible(model, tokenizer, vocab)
    return DrafterFactory(lambda: Gemma4AssistantDrafter(loaded.assistant, model))


def eagle_factory(path: str, model) -> DrafterFactory:
    from mlx_spec.drafters.eagle3 import Eagle3Drafter, load_eagle3_drafter

    eagle_head = load_eagle3_drafter(path, model).module
    return DrafterFactory(lambda: Eagle3Drafter(eagle_head, model), lambda: BatchEagle3(eagle_head))


def dflash_factory(path: str, model) -> DrafterFactory:
    from mlx_spec.drafters.dflash import DFlashDrafter, load_dflash_drafter

    block = load_dflash_drafter(path, model).model
    return DrafterFactory(lambda: DFlashDrafter(block, model), lambda: BatchDFlash(block))


def group_factory(factories: dict[str, DrafterFactory]) -> DrafterFactory:
    """Every drafter offered as one `DrafterGroup`; of the drafters that read different target
    features, the first joins."""
    makers = list(factories.values())
    readers = [name for name in FEATURE_READERS if name in factories]
    for name in readers[1:]:
        makers.remove(factories[name])
    return DrafterFactory(lambda: DrafterGroup([make() for make in makers]))


def check_sharded_drafters(model: nn.Module, drafters: dict) -> None:
    """On a sharded target: refuse a drafter it cannot serve (`distributed.check_drafter`)."""
    if distributed.sharding_of(model) is None:
        return
    for name, make in drafters.items():
        if name != ALL:
            drafter = make()
            distributed.check_drafter(model, drafter, hidden_layer_ids(drafter))
