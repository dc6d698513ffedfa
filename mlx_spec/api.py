"""Public API: load, load_drafter, stream_generate, generate."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mlx_spec.core.compat import scored_vocab
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.core.stats import SpecStats
from mlx_spec.core.stopping import StopMatcher
from mlx_spec.decoding import distributed
from mlx_spec.decoding.chain import Round, plain_rounds, speculative_rounds
from mlx_spec.decoding.policy import (
    MEMORY_ENV,
    AdaptiveDraftLength,
    DraftPolicy,
    FixedDraftLength,
    PolicyFile,
    memory_of,
)
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.decoding.tree import (
    TreeAsChain,
    TreeDrafter,
    TreeTarget,
    tree_rounds,
    tree_unsupported,
)
from mlx_spec.drafters import dflash as dflash_drafter
from mlx_spec.drafters import eagle3 as eagle3_drafter
from mlx_spec.drafters import mtp as mtp_drafter
from mlx_spec.drafters.base import Drafter, hidden_layer_ids, hidden_wanted, unique_id
from mlx_spec.drafters.branching import BranchingDraftModel, BranchingMTP
from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.drafters.group import DrafterGroup
from mlx_spec.drafters.lookahead import LookaheadDrafter
from mlx_spec.drafters.medusa import MedusaDrafter, load_medusa_heads
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.models.mtp import target_hidden_size
from mlx_spec.platform import blas as _blas
from mlx_spec.platform import weight_layout

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass
class GenerationChunk:
    """One streamed token. The last chunk has `token=None`, `finish_reason` and `stats` set."""

    text: str
    token: int | None
    from_draft: bool = False
    finish_reason: str | None = None
    stats: SpecStats | None = None
    stop_sequence: str | None = None  # on the last chunk: the stop string that ended the output


@dataclass
class GenerationResult:
    """What `generate` returns; unpacks as `text, stats = generate(...)`."""

    text: str
    stats: SpecStats
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"

    def __iter__(self):
        return iter((self.text, self.stats))


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


SOURCE_ATTR = "_mlx_spec_source"


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


def load_drafter(path_or_hub_id: str, *, revision: str | None = None) -> Drafter:
    """Load a small draft model (same tokenizer as the target) as a drafter for `drafter=`."""
    model, tokenizer = load(path_or_hub_id, revision=revision)
    return _from_folder(DraftModelDrafter(model, tokenizer), getattr(model, SOURCE_ATTR))


def _from_folder(drafter: Drafter, path) -> Drafter:
    """`drafter`, marked with the folder it was loaded from (what names it across processes,
    `lasting_identity`)."""
    drafter.source = Path(path)
    return drafter


DrafterSpec = Drafter | TreeDrafter | str | Sequence[Drafter | str] | None


def _resolve_drafter(drafter: DrafterSpec, model: nn.Module) -> Drafter | TreeDrafter | None:
    if drafter is None or isinstance(drafter, Drafter | TreeDrafter):
        return drafter
    if not isinstance(drafter, str):  # several: the policy picks one each round
        members = [_resolve_drafter(d, model) for d in drafter]
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


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | Sequence[int]) -> list[int]:
    """Token ids of the prompt (BOS added unless the text already starts with it)."""
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def _check_prompt_ids(ids: list[int], vocab: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")


AUTO = "auto"


def _check_settings(num_draft, max_tokens: int, max_draft: int = 8) -> None:
    if isinstance(num_draft, DraftPolicy):
        pass
    elif num_draft != AUTO and (not isinstance(num_draft, int) or num_draft < 0):
        raise ValueError(f"num_draft must be 'auto' or an integer >= 0, got {num_draft!r}")
    if not isinstance(max_draft, int) or max_draft < 1:
        raise ValueError(f"max_draft must be an integer >= 1, got {max_draft!r}")
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens}")


def draft_label(num_draft) -> int | str:
    """How `num_draft` is reported in the stats: k, "auto", or the policy's description."""
    return num_draft.describe() if isinstance(num_draft, DraftPolicy) else num_draft


def make_policy(
    num_draft: int | str | DraftPolicy,
    max_draft: int,
    drafter: Drafter,
    *,
    model: nn.Module | None = None,
    sampling: SamplingConfig | None = None,
) -> DraftPolicy:
    """The draft-length policy for `num_draft`: "auto" measures and adapts k in 0..max_draft
    (and picks among a group's drafters); an integer drafts that many every round; a
    `DraftPolicy` is used as it is. With `model`, an "auto" policy is taken from the
    target's `PolicyMemory` (what earlier generations with the same drafter and sampling
    settings learned), else made new."""
    if isinstance(num_draft, DraftPolicy):
        return num_draft
    arms = len(drafter.arm_names)
    if num_draft == AUTO:
        if model is None:
            return AdaptiveDraftLength(max_draft, arms)
        key = (drafter.identity, sampling, max_draft)
        return memory_of(model).get(key, lambda: _remembered(max_draft, model, drafter, sampling))
    if arms > 1:
        return AdaptiveDraftLength(num_draft, arms, fixed=num_draft)
    return FixedDraftLength(num_draft)


def _remembered(max_draft: int, model, drafter: Drafter, sampling) -> AdaptiveDraftLength:
    """A new "auto" policy, taking up what earlier processes learned with the same target,
    drafter, sampling settings and machine (`PolicyFile`), and keeping its own there."""
    policy = AdaptiveDraftLength(max_draft, len(drafter.arm_names))
    kept = _policy_file(model, drafter, sampling, max_draft)
    if kept is not None:
        state = kept.load()
        if state is not None:
            policy.restore(state)
        object.__setattr__(policy, "kept", kept)
    return policy


def _policy_file(model, drafter: Drafter, sampling, max_draft: int) -> PolicyFile | None:
    """Where the policy of this target, drafter and settings is kept on this machine; None when
    it is not kept (`MLX_SPEC_POLICY_MEMORY=0`, a target or drafter not loaded from a folder)."""
    from mlx_spec import embedded

    if os.environ.get(MEMORY_ENV, "1").strip() == "0":
        return None
    source = getattr(model, SOURCE_ATTR, None)
    arms = lasting_identity(drafter)
    if source is None or arms is None:
        return None
    key = {
        "machine": machine_key(),
        "target": str(Path(source).resolve()),
        "drafter": arms,
        "sampling": dataclasses.asdict(sampling),
        "max_draft": max_draft,
    }
    return PolicyFile(embedded.cache_root() / "policies", key)


def lasting_identity(drafter: Drafter):
    """What names `drafter` across processes (its kind and the folder it was loaded from; a
    group: its members'); None when something of it was not loaded from a folder."""
    members = getattr(drafter, "drafters", None)
    if members is not None:
        parts = [lasting_identity(d) for d in members]
        return None if any(p is None for p in parts) else parts
    if isinstance(drafter, NgramDrafter):
        return list(drafter.identity)
    source = getattr(drafter, "source", None)
    return None if source is None else [drafter.name, str(Path(source).resolve())]


def machine_key() -> dict:
    """The machine and how MLX computes on it (what the measured costs depend on)."""
    import platform

    return {
        "node": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "device": str(mx.default_device()),
        "blas": _blas.describe(),
    }


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: str | Sequence[int],
    *,
    drafter: DrafterSpec = None,
    num_draft: int | str = AUTO,
    max_draft: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    max_tokens: int = 256,
    seed: int | None = None,
    stop: Sequence[str] = (),
) -> Iterator[GenerationChunk]:
    """Generate from the target, speculatively when a drafter is given; output is distributed
    exactly as plain sampling from the target with the same settings.

    Args:
        model, tokenizer: the target, e.g. from `load`.
        prompt: text or token ids.
        drafter: None (plain decoding), "ngram" (prompt lookup), "mtp" (the MTP head converted
            beside the target), a `Drafter`, or a list of these (each round drafts with the
            one the policy expects to be fastest).
        num_draft: "auto" (default): each round's k in 0..max_draft maximises the expected
            tokens per second from the acceptance and costs measured so far, falling back to
            plain decoding when speculation does not pay; or a fixed k (0 decodes plainly).
            A `DraftPolicy` object chooses each round itself.
        max_draft: the longest draft "auto" considers.
        temperature, top_p, top_k, min_p: sampling settings (temperature 0 = greedy).
        max_tokens: generated tokens at most.
        seed: seeds MLX's random generator for reproducible sampling.
        stop: strings that end the output (not included).
    Yields:
        One `GenerationChunk` per token, then a final chunk with `token=None` and the stats.
    """
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    _check_settings(num_draft, max_tokens, max_draft)
    tokenizer = wrap_tokenizer(tokenizer)
    whole = distributed.whole(model)  # a sharded target's unsharded (lazy) twin
    vocab = scored_vocab(whole, tokenizer)
    ids = checked_prompt(tokenizer, prompt, vocab)
    drafter = _resolve_drafter(drafter, whole)
    if num_draft == 0:
        drafter = None
    sync = distributed.sync_for(model)
    if isinstance(drafter, TreeDrafter) and sync is not None:
        warnings.warn(
            f"a sharded target verifies chains only: {drafter.name} drafts chains (its first "
            "candidates) instead",
            stacklevel=2,
        )
        drafter = TreeAsChain(drafter)
    if isinstance(drafter, TreeDrafter) and (reason := tree_unsupported(model)) is not None:
        warnings.warn(
            f"{reason}: {drafter.name} drafts chains (its first candidates) instead", stacklevel=2
        )
        drafter = TreeAsChain(drafter)
    stats = SpecStats(
        drafter=drafter.name if drafter else "none",
        num_draft=draft_label(num_draft),
        prompt_tokens=len(ids),
    )
    if isinstance(drafter, TreeDrafter):
        yield from _tree_stream(
            model,
            tokenizer,
            ids,
            drafter,
            vocab,
            sampling,
            num_draft,
            max_tokens,
            seed,
            stats,
            stop,
        )
        return
    if drafter is not None:
        drafter.check_compatible(whole, tokenizer, vocab)
        distributed.check_drafter(model, drafter, hidden_layer_ids(drafter))
    target = ModelRunner(
        model,
        vocab,
        rollback=drafter is not None,
        keep_hidden=hidden_wanted(drafter),
    )
    check_fits(ids, target)
    if sync is not None:  # every rank draws the same random numbers
        seed = sync.shared_seed(seed)
        stats.world_size = sync.size
    if seed is not None:
        mx.random.seed(seed)
    policy = None
    if drafter is not None:
        policy = make_policy(num_draft, max_draft, drafter, model=model, sampling=sampling)
    try:
        yield from _stream(
            target, drafter, ids, tokenizer, sampling, policy, max_tokens, stats, stop
        )
    finally:
        kept = getattr(policy, "kept", None)
        if kept is not None:
            kept.save(policy.state())


def _tree_stream(
    model, tokenizer, ids, drafter, vocab, sampling, num_draft, max_tokens, seed, stats, stop
) -> Iterator[GenerationChunk]:
    """`stream_generate` with a tree drafter: every round verifies a tree in one pass; the
    depth is `num_draft` (at most the drafter's; "auto": the drafter's)."""
    drafter.check_compatible(target_hidden_size(model), vocab)
    if num_draft == AUTO:
        key = ("tree", unique_id(drafter), sampling, drafter.max_depth)
        policy = memory_of(model).get(key, lambda: AdaptiveDraftLength(drafter.max_depth))
    elif isinstance(num_draft, DraftPolicy):
        policy = num_draft
    else:
        policy = FixedDraftLength(min(int(num_draft), drafter.max_depth))
    target = TreeTarget(model, vocab, keep_hidden=hidden_wanted(drafter))
    check_fits(ids, target)
    if seed is not None:
        mx.random.seed(seed)
    tic = time.perf_counter()
    drafter.begin(ids, target.prefill(ids[:-1]))
    stats.prefill_seconds = time.perf_counter() - tic
    rounds = tree_rounds(
        target, drafter, ids[-1], sampling=sampling, max_tokens=max_tokens, policy=policy,
        stats=stats,
    )  # fmt: skip
    yield from _emit(rounds, tokenizer, stats, stop, max_tokens)


def wrap_tokenizer(tokenizer) -> TokenizerWrapper:
    """mlx-lm's `TokenizerWrapper` around a tokenizer (unchanged if it is one)."""
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def checked_prompt(tokenizer: TokenizerWrapper, prompt: str | Sequence[int], vocab: int):
    """The prompt's token ids; ValueError when it is empty or holds ids outside the vocabulary."""
    ids = encode_prompt(tokenizer, prompt)
    _check_prompt_ids(ids, vocab)
    return ids


def check_fits(ids: list[int], target: ModelRunner | TreeTarget) -> None:
    """ValueError when the prompt leaves no room in the target's context."""
    if target.context_limit is not None and len(ids) >= target.context_limit:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; the model's context holds {target.context_limit}"
        )


def _stream(target, drafter, ids, tokenizer, sampling, policy, max_tokens, stats, stop):
    tic = time.perf_counter()
    hidden = target.prefill(ids[:-1])
    if drafter is not None:
        drafter.bind_target(target)
        drafter.begin(ids, target.vocab_size, hidden)
    stats.prefill_seconds = time.perf_counter() - tic
    yield from decode(
        target, drafter, ids[-1], tokenizer, sampling, policy, max_tokens, stats, stop
    )


def decode(
    target: ModelRunner,
    drafter: Drafter | None,
    last: int,
    tokenizer: TokenizerWrapper,
    sampling: SamplingConfig,
    policy: DraftPolicy | None,
    max_tokens: int,
    stats: SpecStats,
    stop: Sequence[str],
    trace: list[int] | None = None,
) -> Iterator[GenerationChunk]:
    """Decode after the prompt: `target` holds every prompt token but `last`, the drafter (if
    any) has been begun or extended on the same sequence. Yields the chunks of
    `stream_generate`. When the output ends or the consumer closes the generator, the caches
    hold the sequence up to its last kept token; `trace` (if given) gets the tokens added to
    the sequence (beyond what is emitted: an EOS token, or the token the plain pipeline fed)."""
    replays = _replays(target, drafter)
    if target.sync is not None:  # the last generation's queued passes: finished everywhere
        distributed.settle_streams()
    if drafter is None:
        rounds = plain_rounds(target, last, sampling=sampling, max_tokens=max_tokens, trace=trace)
    else:
        rounds = speculative_rounds(
            target,
            drafter,
            last,
            policy=policy,
            sampling=sampling,
            max_tokens=max_tokens,
            stats=stats,
            trace=trace,
        )
    if target.sync is not None:
        rounds = _counting_comm(rounds, target.sync.ledger, stats)
    try:
        yield from _emit(rounds, tokenizer, stats, stop, max_tokens)
    finally:
        stats.replays += _replays(target, drafter) - replays


def _counting_comm(rounds: Iterator[Round], ledger, stats: SpecStats) -> Iterator[Round]:
    """`rounds`, with the collectives they build (a sharded target's) added to the stats when
    they end (before the final chunk carries the stats)."""
    with ledger.counting() as counted:
        try:
            yield from rounds
        finally:
            rounds.close()
            collectives, nbytes = counted()
            stats.comm_collectives += collectives
            stats.comm_seconds += ledger.price(collectives, nbytes)


def _replays(target: ModelRunner, drafter: Drafter | None) -> int:
    return target.replays + getattr(getattr(drafter, "runner", None), "replays", 0)


class OutputCutter:
    """Turns one generation's rounds into chunks, cutting at EOS, a stop string or max_tokens.

    `round(rnd)` returns the round's chunks up to the first stopping point, the finish reason
    if the output ended there, and how many of the round's tokens stay in the sequence (an EOS
    token does; None: all); `final(finish)` the last chunk (held-back text, finish reason and
    stats). The stats observe each round as it was emitted.
    """

    def __init__(self, tokenizer, stats: SpecStats, stop: Sequence[str], max_tokens: int):
        self.detokenizer = copy.copy(tokenizer.detokenizer)  # own state: streams may interleave
        self.detokenizer.reset()
        self.eos = set(tokenizer.eos_token_ids)
        self.stopper = StopMatcher(stop)
        self.stats, self.max_tokens = stats, max_tokens

    def round(self, rnd: Round) -> tuple[list[GenerationChunk], str | None, int | None]:
        chunks = []
        for i, token in enumerate(rnd.tokens):
            if token in self.eos:
                return chunks, "stop", i + 1
            self.detokenizer.add_token(token)
            text, hit = self.stopper.feed(self.detokenizer.last_segment)
            chunks.append(GenerationChunk(text=text, token=token, from_draft=i < rnd.num_accepted))
            if hit:
                return chunks, "stop", i + 1
            if self.stats.generated_tokens + len(chunks) >= self.max_tokens:
                return chunks, "length", i + 1
        return chunks, None, None

    def final(self, finish: str | None) -> GenerationChunk:
        self.detokenizer.finalize()
        tail = self.stopper.feed(self.detokenizer.last_segment)[0] + self.stopper.flush()
        return GenerationChunk(
            text=tail,
            token=None,
            finish_reason=finish or "length",
            stats=self.stats,
            stop_sequence=self.stopper.hit,
        )


def _emit(
    rounds: Iterator[Round], tokenizer, stats: SpecStats, stop: Sequence[str], max_tokens: int
) -> Iterator[GenerationChunk]:
    """Turn rounds into chunks (`OutputCutter`); each round is cut (`Round.keep`) where the
    output ended, or after the last chunk its consumer took."""
    cutter = OutputCutter(tokenizer, stats, stop, max_tokens)
    finish, tic = "length", time.perf_counter()
    try:
        for rnd in rounds:
            emitted, finish, keep = cutter.round(rnd)
            for i, chunk in enumerate(emitted):
                rnd.keep = i + 1
                try:
                    yield chunk
                except GeneratorExit:  # the consumer stopped listening after this chunk
                    stats.observe_round(rnd.num_drafted, rnd.num_accepted, i + 1, rnd.seconds)
                    raise
            rnd.keep = keep
            stats.observe_round(rnd.num_drafted, rnd.num_accepted, len(emitted), rnd.seconds)
            if finish is not None:
                break
        else:
            finish = "length"
    finally:
        rounds.close()
        stats.decode_seconds = time.perf_counter() - tic
    yield cutter.final(finish)


def generate(
    model: nn.Module,
    tokenizer,
    prompt: str | Sequence[int],
    *,
    drafter: DrafterSpec = None,
    num_draft: int | str = AUTO,
    max_draft: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    max_tokens: int = 256,
    seed: int | None = None,
    stop: Sequence[str] = (),
) -> GenerationResult:
    """Run `stream_generate` to the end; the arguments are those of `stream_generate`.

    Returns:
        A `GenerationResult` (text, stats, tokens, finish_reason); unpacks as `text, stats`.
    """
    stream = stream_generate(
        model,
        tokenizer,
        prompt,
        drafter=drafter,
        num_draft=num_draft,
        max_draft=max_draft,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_tokens=max_tokens,
        seed=seed,
        stop=stop,
    )
    pieces, tokens, last = [], [], None
    for chunk in stream:
        pieces.append(chunk.text)
        if chunk.token is not None:
            tokens.append(chunk.token)
        last = chunk
    return GenerationResult("".join(pieces), last.stats, tokens, last.finish_reason)
