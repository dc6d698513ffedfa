"""Loading a run's target and drafters, with the header lines that name them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx_spec
from mlx_spec import embedded
from mlx_spec.bench.config import (
    DFLASH,
    DRAFT_MODEL,
    DRAFT_TREE,
    EAGLE3,
    EAGLE3_TREE,
    MEDUSA,
    MTP,
    MTP_TREE,
    PEER,
    BenchConfig,
    asked_for,
    wants,
)
from mlx_spec.bench.machine import param_count, shown_path
from mlx_spec.core.paths import SOURCE_ATTR
from mlx_spec.decoding import distributed
from mlx_spec.drafters.base import Drafter
from mlx_spec.drafters.mtp import MTP_DIR

DRAFT_MODES = (DRAFT_MODEL, PEER, DRAFT_TREE)  # the modes that run the draft model


@dataclass
class Loaded:
    """The run's models and drafters, the header lines naming them and notes for the report."""

    model: object
    tokenizer: object
    draft: Drafter | None
    mtp: Drafter | None
    header: dict
    notes: list[str]
    medusa: object = None  # a MedusaDrafter (a tree drafter: never in the group)
    eagle: Drafter | None = None  # reads other target features than MTP: not in the group
    dflash: Drafter | None = None  # likewise


def load_models(config: BenchConfig) -> Loaded:
    """The target and every drafter `config` runs (the embedded pair when `config.model` is
    None); raises ValueError when a mode asked for has no drafter."""
    model_path, draft_path = config.model, config.draft_model
    if model_path is None:
        target_dir, draft_dir = embedded.converted_pair()
        model_path = str(target_dir)
        if draft_path is None and any(wants(config, m) for m in DRAFT_MODES):
            draft_path = str(draft_dir)
    needs_draft = config.modes is not None and (set(DRAFT_MODES) & set(config.modes))
    if needs_draft and draft_path is None:
        raise ValueError("modes draft-model and mlx-lm need a draft model (--draft-model PATH)")
    model, tokenizer = mlx_spec.load(model_path, shard=config.shard)
    what = " (the embedded demo pair)" if config.model is None else ""
    size = param_count(model) / 1e6
    header = {"target": f"{shown_path(model_path)}{what} ({size:.1f}M parameters)"}
    sharding = distributed.sharding_of(model)
    if sharding is not None:
        header["sharded"] = f"{sharding.mode} parallel over {sharding.size} ranks"
    local = Path(getattr(model, SOURCE_ATTR, model_path))  # a hub id's download
    draft = _load_draft(config, draft_path, header)
    mtp = _load_mtp(config, model, model_path, local, header)
    eagle = _load_eagle(config, model, model_path, local, header)
    block = _load_dflash(config, model, model_path, local, header)
    medusa = _load_medusa(config, model_path, local, header)
    return Loaded(model, tokenizer, draft, mtp, header, [], medusa, eagle, block)


def _load_draft(config: BenchConfig, draft_path: str | None, header: dict) -> Drafter | None:
    if draft_path is None or not any(wants(config, m) for m in DRAFT_MODES):
        return None
    draft = mlx_spec.load_drafter(draft_path)
    size = param_count(draft.model) / 1e6
    header["draft_model"] = f"{shown_path(draft_path)} ({size:.1f}M parameters)"
    return draft


def _load_mtp(config: BenchConfig, model, model_path, local: Path, header: dict):
    if not (wants(config, MTP) or wants(config, MTP_TREE)):
        return None
    mtp_path = config.mtp
    if mtp_path is None and (local / MTP_DIR / "config.json").is_file():
        mtp_path = ""
    if mtp_path is not None:
        mtp = mlx_spec.load_mtp_drafter(mtp_path or str(local), model)
        header["mtp"] = shown_path(Path(mtp_path) if mtp_path else local / MTP_DIR)
        return mtp
    if config.modes is not None:
        raise ValueError(
            f"mode mtp/mtp-tree: {model_path} has no {MTP_DIR}/ drafter; pass --mtp DIR"
        )
    return None


def _load_eagle(config: BenchConfig, model, model_path, local: Path, header: dict):
    wants_eagle = wants(config, EAGLE3) or asked_for(config, EAGLE3_TREE)
    if wants_eagle and (local / EAGLE3 / "config.json").is_file():
        eagle = mlx_spec.load_eagle3_drafter(str(local), model)
        ids = list(eagle.hidden_layers)
        header["eagle3"] = f"{shown_path(local / EAGLE3)} (target layers {ids})"
        return eagle
    if config.modes is not None and {EAGLE3, EAGLE3_TREE} & set(config.modes):
        raise ValueError(f"mode eagle3/eagle3-tree: {model_path} has no {EAGLE3}/ head")
    return None


def _load_dflash(config: BenchConfig, model, model_path, local: Path, header: dict):
    if wants(config, DFLASH) and (local / DFLASH / "config.json").is_file():
        block = mlx_spec.load_dflash_drafter(str(local), model)
        size = block.model.cfg.block_size
        where = shown_path(local / DFLASH)
        header["dflash"] = f"{where} (block {size}, layers {block.hidden_layers})"
        return block
    if asked_for(config, DFLASH):
        raise ValueError(f"mode dflash: {model_path} has no {DFLASH}/ drafter")
    return None


def _load_medusa(config: BenchConfig, model_path, local: Path, header: dict):
    if not asked_for(config, MEDUSA):  # tree modes run when asked for
        return None
    if not (local / MEDUSA).is_dir():
        raise ValueError(f"mode medusa: {model_path} has no {MEDUSA}/ heads")
    medusa = mlx_spec.load_medusa_drafter(str(local))
    header["medusa"] = f"{shown_path(local / MEDUSA)} ({medusa.max_depth} heads)"
    return medusa
