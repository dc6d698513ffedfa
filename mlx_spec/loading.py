"""Loading targets and drafters: MLX directories, hub ids, short names of known models."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from mlx_spec.core.paths import SOURCE_ATTR
from mlx_spec.decoding import distributed
from mlx_spec.decoding.tree import (
    TreeDrafter,
)
from mlx_spec.drafters import dflash as dflash_drafter
from mlx_spec.drafters import eagle3 as eagle3_drafter
from mlx_spec.drafters import mtp as mtp_drafter
from mlx_spec.drafters.base import Drafter
from mlx_spec.drafters.branching import BranchingDraftModel, BranchingMTP
from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.drafters.group import DrafterGroup
from mlx_spec.drafters.lookahead import LookaheadDrafter
from mlx_spec.drafters.medusa import MedusaDrafter, load_medusa_heads
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.platform import weight_layout

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper


def _resolve_path(path_or_hub_id: str) -> str:
    from mlx_spec import catalog

    if (model := catalog.known(path_or_hub_id)) is not None:  # a short name: smollm2
        return str(catalog.model_dir(model))
    path = os.path.expanduser(path_or_hub_id)
    if os.path.exists(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path_or_hub_id}: not a model directory (no config.json)")
        return path
    looks_local = path_or_hub_id.startswith((".", "/", "~")) or path_or_hub_id.count("/") != 1
    if looks_local:
        raise FileNotFoundError(f"{path_or_hub_id}: no such model directory")
    return path_or_hub_id


def load(
    path_or_hub_id: str,
    *,
    revision: str | None = None,
    shard: str | None = None,
    group: mx.distributed.Group | None = None,
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load an MLX model directory or Hugging Face hub id with mlx-lm.

    On the CPU device floating-point weights are cast to float32 (the only fast CPU matmul).

    Args:
        path_or_hub_id: a local directory, `org/name` on the hub, or a short name of a known
            model ("smollm2": converted into the cache on first use, see `catalog`).
        revision: hub revision (branch, tag or commit).
        shard: in a distributed run (`mlx.launch`), split the target over the ranks: "tensor",
            "pipeline" or "auto" (tensor parallel where the architecture allows it); each rank
            reads only its part of the weights. None: load the whole model.
        group: the ranks to shard over (default: the group this process was launched in).
    Returns:
        (model, tokenizer)
    """
    from mlx_lm.utils import load as mlx_lm_load

    local = _local_dir(_resolve_path(path_or_hub_id), revision)
    if shard is not None:
        group = group if group is not None else distributed.world()
        if group is not None and group.size() > 1:
            return _load_sharded(path_or_hub_id, local, shard, group)
    try:
        with quiet_transformers():
            model, tokenizer = mlx_lm_load(str(local))
    except (FileNotFoundError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path_or_hub_id}: cannot load model: {exc}") from exc
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
        weight_layout.decide(model)  # the first model loaded times the layouts
        weight_layout.column_major(model)
    mx.eval(model.parameters())
    object.__setattr__(model, SOURCE_ATTR, local)  # so drafter="mtp" finds <dir>/mtp
    return model, tokenizer


def _load_sharded(name: str, local: Path, mode: str, group) -> tuple[nn.Module, TokenizerWrapper]:
    """The target split over `group`, its unsharded lazy twin kept beside it for drafters
    that borrow a layer, the embedding or the head (`distributed.whole`)."""
    from mlx_lm.utils import load_model, load_tokenizer

    try:
        with quiet_transformers():
            model, config = load_model(local, lazy=True)
            twin, _ = load_model(local, lazy=True)
            tokenizer = load_tokenizer(local, eos_token_ids=config.get("eos_token_id", None))
    except (FileNotFoundError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{name}: cannot load model: {exc}") from exc
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
        twin.set_dtype(mx.float32)
    distributed.check_same(group, distributed.fingerprint(local, twin), "model")
    used = distributed.shard_target(model, group, mode)
    weight_layout.column_major(model)  # each rank's own part, after the split
    mx.eval(model.parameters())
    for m in (model, twin):
        object.__setattr__(m, SOURCE_ATTR, local)
    object.__setattr__(model, distributed.UNSHARDED_ATTR, twin)
    object.__setattr__(model, distributed.SHARDING_ATTR, distributed.Sharding(group, used))
    distributed.barrier(group)
    return model, tokenizer


@contextmanager
def quiet_transformers():
    """Silence transformers' notices while mlx-lm reads a tokenizer and config through it
    (model-type mismatches between the MLX config and transformers' classes, deprecated
    config keys such as `rope_scaling`): they concern transformers' models, not this run."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers comes with mlx-lm
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
            yield
    finally:
        hf_logging.set_verbosity(level)


def _local_dir(source: str, revision: str | None) -> Path:
    if os.path.exists(source):
        return Path(source)
    from mlx_lm.utils import _download  # the hub fetch mlx_lm.load itself uses

    try:
        return Path(_download(source, revision=revision))
    except Exception as exc:  # network, auth and cache misses come in many types
        raise FileNotFoundError(
            f"{source}: not a local directory and could not be fetched from the Hugging Face "
            f"hub ({type(exc).__name__}: {exc})"
        ) from exc


def load_drafter(path_or_hub_id: str, *, revision: str | None = None) -> Drafter:
    """Load a small draft model (same tokenizer as the target) as a drafter for `drafter=`."""
    model, tokenizer = load(path_or_hub_id, revision=revision)
    return _from_folder(DraftModelDrafter(model, tokenizer), getattr(model, SOURCE_ATTR))


def _from_folder(drafter: Drafter, path) -> Drafter:
    """`drafter`, marked with the folder it was loaded from (what names it across processes,
    `lasting_identity`)."""
    drafter.source = Path(path)
    return drafter


def load_mtp_drafter(path: str, model: nn.Module) -> Drafter:
    """Load the MTP drafter that `mlx-spec convert` wrote for `model`.

    Args:
        path: the drafter directory, or the converted target directory holding it in `mtp/`.
        model: the target, loaded.
    """
    return _from_folder(mtp_drafter.load_mtp_drafter(path, distributed.whole(model)), path)


def load_medusa_drafter(
    path: str, *, width: int = 3, tree_size: int | None = None
) -> MedusaDrafter:
    """Load Medusa heads (the original Medusa layout or vLLM's) as a tree drafter.

    Args:
        path: the heads' directory (or weights file), or a converted target directory holding
            them in `medusa/`.
        width: candidates per head.
        tree_size: nodes per tree at most (default: two per level).
    """
    source = Path(path)
    if (source / "medusa").is_dir():
        source = source / "medusa"
    return MedusaDrafter(load_medusa_heads(str(source)), width=width, tree_size=tree_size)


def load_branching_drafter(
    path_or_hub_id: str,
    *,
    width: int = 2,
    max_depth: int = 4,
    dynamic: bool = False,
    revision: str | None = None,
) -> BranchingDraftModel:
    """Load a small draft model as a tree drafter: its `width` best candidates at the first
    position, each continued greedily (verified as a tree in one target pass), or with
    `dynamic` EAGLE-2's dynamic tree (`width` candidates expanded per level)."""
    model, _ = load(path_or_hub_id, revision=revision)
    return BranchingDraftModel(model, width=width, max_depth=max_depth, dynamic=dynamic)


def load_eagle3_drafter(path: str, model: nn.Module) -> Drafter:
    """Load an EAGLE-3 head for `model`: the EAGLE repository's layout, the speculators
    format, or one converted by `mlx-spec convert` (a directory, or a converted target
    holding it in `eagle3/`). Its target layers, hidden size and vocabulary are checked."""
    return _from_folder(eagle3_drafter.load_eagle3_drafter(path, distributed.whole(model)), path)


def load_dflash_drafter(path: str, model: nn.Module) -> Drafter:
    """Load a DFlash block drafter for `model`: z-lab's layout, the speculators format, or
    one converted by `mlx-spec convert` (a directory, or a converted target holding it in
    `dflash/`). Its tapped layers, width and mask token are checked against the target."""
    return _from_folder(dflash_drafter.load_dflash_drafter(path, distributed.whole(model)), path)


def load_branching_mtp(
    path: str, model: nn.Module, *, width: int = 2, max_depth: int = 4, dynamic: bool = False
) -> BranchingMTP:
    """Load the MTP head converted beside `model` as a tree drafter: its `width` best
    candidates after the pending token, each continued by the head's own greedy chain, or
    with `dynamic` EAGLE-2's dynamic tree (`width` candidates expanded per level)."""
    module = mtp_drafter.load_mtp_drafter(path, distributed.whole(model)).module
    return BranchingMTP(module, width=width, max_depth=max_depth, dynamic=dynamic)


def load_eagle3_tree(
    path: str, model: nn.Module, *, width: int = 2, max_depth: int = 4, dynamic: bool = True
) -> BranchingMTP:
    """Load an EAGLE-3 head (as `load_eagle3_drafter` does) as a tree drafter: by default
    EAGLE-2's dynamic tree, `width` candidates expanded per level, each proposing its `width`
    best children, the `width * depth` likeliest paths verified in one target pass."""
    module = eagle3_drafter.load_eagle3_drafter(path, distributed.whole(model)).module
    return BranchingMTP(module, width=width, max_depth=max_depth, dynamic=dynamic)


DrafterSpec = Drafter | TreeDrafter | str | Sequence[Drafter | str] | None


def resolve_drafter(drafter: DrafterSpec, model: nn.Module) -> Drafter | TreeDrafter | None:
    if drafter is None or isinstance(drafter, Drafter | TreeDrafter):
        return drafter
    if not isinstance(drafter, str):  # several: the policy picks one each round
        members = [resolve_drafter(d, model) for d in drafter]
        if not members or any(m is None for m in members):
            raise ValueError("a list of drafters must name at least one drafter and no None")
        if any(isinstance(m, TreeDrafter) for m in members) and len(members) > 1:
            raise ValueError("a tree drafter (Medusa) cannot join a group of drafters")
        return members[0] if len(members) == 1 else DrafterGroup(members)
    if drafter == "ngram":
        return NgramDrafter()
    if drafter == "lookahead":
        return LookaheadDrafter()
    beside = {  # drafters found in a directory beside a converted target: (folder, what,
        # the loader to name otherwise, load(source, model))
        "medusa": ("medusa", "Medusa heads", "load_medusa_drafter(path)",
                   lambda source, _: load_medusa_drafter(source)),
        "dflash": (dflash_drafter.DFLASH_DIR, "a DFlash drafter",
                   "load_dflash_drafter(path, model)", load_dflash_drafter),
        "eagle3": (eagle3_drafter.EAGLE_DIR, "an EAGLE-3 head",
                   "load_eagle3_drafter(path, model)", load_eagle3_drafter),
    }  # fmt: skip
    if drafter in beside:
        folder, what, hint, load_it = beside[drafter]
        source = getattr(model, SOURCE_ATTR, None)
        if source is None or not (Path(source) / folder).is_dir():
            raise ValueError(
                f"drafter={drafter!r} needs a target from mlx_spec.load() with {what} in its "
                f"{folder}/ directory; otherwise pass {hint}"
            )
        return load_it(str(source), model)
    if drafter == "mtp":
        source = getattr(model, SOURCE_ATTR, None)
        if source is None:
            raise ValueError(
                "drafter='mtp' needs a target from mlx_spec.load(); otherwise "
                "pass load_mtp_drafter(path, model)"
            )
        return load_mtp_drafter(str(source), model)
    raise ValueError(
        f"unknown drafter {drafter!r}: pass 'ngram', 'mtp', 'eagle3', 'dflash', 'medusa', "
        "'lookahead', a drafter from load_drafter(), or None"
    )
