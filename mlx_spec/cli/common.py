"""What several `mlx-spec` commands share: drafter, shard and sampling flags, the target."""

from __future__ import annotations

import mlx_spec
from mlx_spec.drafters.lookahead import LookaheadDrafter

DEFAULT_ASSISTANT = "smollm2"  # chat and serve without --model: a real instruct model


def parse_num_draft(text: str) -> int | str:
    """An integer, or the text as given ('auto'; anything else is refused by the library
    with a one-line error)."""
    try:
        return int(text)
    except ValueError:
        return text


def add_drafter_flags(p) -> None:
    """The drafter choice shared by generate, chat and serve (several flags together: each
    round drafts with the one expected to be fastest)."""
    drafters = p.add_argument_group("drafters (one, or several: chosen between every round)")
    drafters.add_argument("--draft-model", help="small draft model with the target's tokenizer")
    drafters.add_argument("--ngram", action="store_true", help="prompt-lookup drafting, no model")
    drafters.add_argument(
        "--mtp",
        nargs="?",
        const="",
        metavar="DIR",
        help="the checkpoint's own MTP head (default: MODEL/mtp, as written by mlx-spec convert)",
    )
    drafters.add_argument(
        "--assistant", metavar="DIR", help="Gemma 4 assistant checkpoint (Gemma 4 targets only)"
    )
    drafters.add_argument(
        "--eagle",
        metavar="DIR",
        help="EAGLE-3 head (the EAGLE repository's layout, the speculators format, or converted "
        "by mlx-spec convert), reading features of several target layers",
    )
    drafters.add_argument(
        "--dflash",
        metavar="DIR",
        help="DFlash block drafter (z-lab's layout, the speculators format, or converted): a "
        "block of drafts in one pass from several target layers' features",
    )
    _add_draft_length_flags(p)


def _add_draft_length_flags(p) -> None:
    p.add_argument(
        "--num-draft",
        type=parse_num_draft,
        default="auto",
        metavar="K|auto",
        help="draft tokens per round; 'auto' (default) picks k in 0..--max-draft every round "
        "from the acceptance and costs measured as it goes, decoding plainly when speculation "
        "does not pay",
    )
    p.add_argument(
        "--max-draft",
        type=int,
        default=8,
        metavar="K",
        help="the longest draft 'auto' considers (default 8)",
    )


def add_shard_flag(p) -> None:
    p.add_argument(
        "--shard",
        choices=("auto", "tensor", "pipeline"),
        default=None,
        help="under a distributed launcher (mlx.launch --backend ring|jaccl|mpi -n N ...): how "
        "the target is split over the ranks; 'auto' (default there) picks tensor parallelism "
        "where the architecture has it, else pipeline stages. Rank 0 prints; the drafter is "
        "replicated on every rank",
    )


def add_sampling_flags(p) -> None:
    """Sampling settings shared by generate and chat."""
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filter (0 = off)")


def make_drafter(args, model):
    """The drafter the flags name; several flags: a group, chosen between every round."""
    chosen = [*_targetless_drafters(args), *_model_drafters(args, model)]
    if len(chosen) > 1:
        return chosen
    return chosen[0] if chosen else None


def _targetless_drafters(args) -> list:
    """Lookahead, Medusa heads and n-gram lookup, in that order: none is loaded with the target."""
    chosen = []
    if getattr(args, "lookahead", False):
        chosen.append(LookaheadDrafter(args.window, args.ngram_size, args.candidates))
    if getattr(args, "medusa", None) is not None:
        chosen.append(
            mlx_spec.load_medusa_drafter(args.medusa or args.model, tree_size=args.tree_size)
        )
    if args.ngram:
        chosen.append("ngram")
    return chosen


def _model_drafters(args, model) -> list:
    """Draft model, MTP head, Gemma 4 assistant, EAGLE-3 head and DFlash, in that order."""
    chosen = []
    branches = getattr(args, "branches", None)
    if args.draft_model and branches:
        chosen.append(
            mlx_spec.load_branching_drafter(
                args.draft_model, width=args.branches, dynamic=args.dynamic_tree
            )
        )
    elif args.draft_model:
        chosen.append(mlx_spec.load_drafter(args.draft_model))
    if args.mtp is not None and branches:
        path = args.mtp or args.model
        chosen.append(
            mlx_spec.load_branching_mtp(path, model, width=args.branches, dynamic=args.dynamic_tree)
        )
    elif args.mtp is not None:
        chosen.append(mlx_spec.load_mtp_drafter(args.mtp, model) if args.mtp else "mtp")
    if args.assistant:
        chosen.append(mlx_spec.load_gemma4_assistant(args.assistant, model))
    chosen += _feature_drafters(args, model, branches)
    return chosen


def _feature_drafters(args, model, branches) -> list:
    """EAGLE-3 (a tree with `branches`) and DFlash: heads over tapped target layers."""
    chosen = []
    if getattr(args, "eagle", None) and branches:
        chosen.append(
            mlx_spec.load_eagle3_tree(
                args.eagle, model, width=args.branches, dynamic=args.dynamic_tree
            )
        )
    elif getattr(args, "eagle", None):
        chosen.append(mlx_spec.load_eagle3_drafter(args.eagle, model))
    if getattr(args, "dflash", None):
        chosen.append(mlx_spec.load_dflash_drafter(args.dflash, model))
    return chosen


def model_defaults(args, default: str | None = None) -> None:
    """Resolve `--model`: unset, `default` (a known model's short name) or else the embedded
    demo pair (converted on first use); a short name, its conversion in the cache. The demo
    pair, or a known model, named without drafter flags offers every drafter it has, n-gram
    lookup included, chosen between every round."""
    from mlx_spec import catalog
    from mlx_spec.embedded import converted_pair

    name = args.model or default
    if name is None:
        target, draft = converted_pair()
        args.model, args.compare = str(target), True
        drafters = {"draft": draft, "mtp": target / "mtp"}
        if args.draft_model == "embedded":
            args.draft_model = str(draft)
    elif (known := catalog.known(name)) is not None:
        target = catalog.model_dir(known)
        args.model = str(target)
        drafters = {kind: target / kind for kind in catalog.shipped_drafters(known)}
    else:
        return
    chosen = (
        args.ngram, args.draft_model, args.mtp is not None, args.assistant, args.eagle,
        args.dflash, getattr(args, "medusa", None) is not None, getattr(args, "lookahead", False),
    )  # fmt: skip
    if any(chosen):
        return
    args.ngram = True
    args.draft_model = str(drafters["draft"]) if "draft" in drafters else None
    args.eagle = str(drafters["eagle3"]) if "eagle3" in drafters else None
    args.mtp = "" if "mtp" in drafters else None  # MODEL/mtp


def load_target(args):
    """The target of `args.model`: split over the ranks when launched distributed."""
    group = getattr(args, "group", None)
    shard = getattr(args, "shard", None)
    check_shard(shard, group)
    if group is None:
        return mlx_spec.load(args.model)
    return mlx_spec.load(args.model, shard=shard or "auto", group=group)


def check_shard(shard: str | None, group) -> None:
    if shard is not None and group is None:
        raise ValueError(
            "--shard splits the target over the ranks of a distributed launch: start the "
            "command with mlx.launch (e.g. mlx.launch --backend ring -n 2 mlx-spec generate ...)"
        )
