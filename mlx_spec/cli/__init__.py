"""The `mlx-spec` command line (argparse lives here and nowhere else)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys

import mlx_spec
from mlx_spec.drafters.lookahead import LookaheadDrafter
from mlx_spec.platform import blas as _blas
from mlx_spec.training.distill import KINDS, DistillConfig

DEFAULT_ASSISTANT = "smollm2"  # chat and serve without --model: a real instruct model

EPILOG = """examples:
  mlx-spec generate --model ./target --draft-model ./draft --prompt "def parse_args(argv):"
  mlx-spec generate --model ./target --ngram --temp 1.0 --seed 0 --prompt "..." --json
  mlx-spec convert --hf-path Qwen/Qwen3-0.6B --mlx-path ./qwen3-0.6b
  mlx-spec bench --quick --json bench.json
  mlx-spec chat --model ./target --ngram --system "Be brief."
  mlx-spec serve --model ./target --draft-model ./draft --port 8080
  mlx-spec info
"""


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text, speculatively when a drafter is given",
        description="Generate from a target model. With --draft-model or --ngram the output is "
        "distributed exactly as plain sampling from the target, only faster.",
    )
    p.add_argument(
        "--model",
        help="target: MLX model directory or hub id (default: the embedded demo pair with "
        "--compare on, offering n-gram lookup, its draft model and its MTP head: each round "
        "drafts with the one measured fastest so far)",
    )
    p.add_argument("--prompt", required=True, help="prompt text ('-' reads standard input)")
    _add_drafter_flags(p)
    _add_shard_flag(p)
    p.add_argument(
        "--medusa",
        nargs="?",
        const="",
        metavar="DIR",
        help="Medusa heads (default: MODEL/medusa): each round the target verifies a tree of "
        "their guesses in one pass; --num-draft is the tree's depth (auto: one level per head)",
    )
    p.add_argument(
        "--lookahead",
        action="store_true",
        help="lookahead decoding, no drafter: each pass also runs Jacobi iterations over a "
        "window of guesses and verifies the n-grams they left that continue the text",
    )
    p.add_argument("--window", type=int, default=4, help="--lookahead: window W (default 4)")
    p.add_argument(
        "--ngram-size", type=int, default=3, help="--lookahead: n-gram size N (default 3)"
    )
    p.add_argument(
        "--candidates", type=int, default=4, help="--lookahead: n-grams verified G (default 4)"
    )
    p.add_argument(
        "--branches",
        type=int,
        metavar="B",
        help="with --draft-model, --mtp or --eagle: draft a tree, the drafter's B best first "
        "tokens each continued greedily, verified in one target pass",
    )
    p.add_argument(
        "--dynamic-tree",
        action="store_true",
        help="with --branches B: EAGLE-2's dynamic tree instead: the B likeliest paths so far "
        "grow B children each, level by level, and the B x depth likeliest are verified",
    )
    p.add_argument(
        "--tree-size",
        type=int,
        metavar="N",
        help="with --medusa: nodes per tree at most (default: two per level)",
    )
    _add_sampling_flags(p)
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate (default 256)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the prompt as it is (default: as the user's message in the model's chat "
        "template, when it has one, as mlx_lm.generate does)",
    )
    p.add_argument("--system", help="a system message before the prompt (with the template)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also decode plainly and report the speedup (on by default without --model)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with text, tokens and stats instead of streaming",
    )
    p.set_defaults(func=cmd_generate)


def _drafter(args, model):
    """The drafter the flags name; several flags: a group, chosen between every round."""
    chosen = []
    if getattr(args, "lookahead", False):
        chosen.append(LookaheadDrafter(args.window, args.ngram_size, args.candidates))
    if getattr(args, "medusa", None) is not None:
        chosen.append(
            mlx_spec.load_medusa_drafter(args.medusa or args.model, tree_size=args.tree_size)
        )
    if args.ngram:
        chosen.append("ngram")
    if args.draft_model and getattr(args, "branches", None):
        chosen.append(
            mlx_spec.load_branching_drafter(
                args.draft_model, width=args.branches, dynamic=args.dynamic_tree
            )
        )
    elif args.draft_model:
        chosen.append(mlx_spec.load_drafter(args.draft_model))
    if args.mtp is not None and getattr(args, "branches", None):
        path = args.mtp or args.model
        chosen.append(
            mlx_spec.load_branching_mtp(path, model, width=args.branches, dynamic=args.dynamic_tree)
        )
    elif args.mtp is not None:
        chosen.append(mlx_spec.load_mtp_drafter(args.mtp, model) if args.mtp else "mtp")
    if args.assistant:
        chosen.append(mlx_spec.load_gemma4_assistant(args.assistant, model))
    if getattr(args, "eagle", None) and getattr(args, "branches", None):
        chosen.append(
            mlx_spec.load_eagle3_tree(
                args.eagle, model, width=args.branches, dynamic=args.dynamic_tree
            )
        )
    elif getattr(args, "eagle", None):
        chosen.append(mlx_spec.load_eagle3_drafter(args.eagle, model))
    if getattr(args, "dflash", None):
        chosen.append(mlx_spec.load_dflash_drafter(args.dflash, model))
    if len(chosen) > 1:
        return chosen
    return chosen[0] if chosen else None


def _model_defaults(args, default: str | None = None) -> None:
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


def cmd_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    _blas.warn_if_slow()
    _model_defaults(args)
    model, tokenizer = _load_target(args)
    if not args.ignore_chat_template:
        prompt = _chat_prompt(tokenizer, prompt, args.system)
    drafter = _drafter(args, model)
    stream = mlx_spec.stream_generate(
        model,
        tokenizer,
        prompt,
        drafter=drafter,
        num_draft=args.num_draft,
        max_draft=args.max_draft,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    pieces, tokens, last = [], [], None
    for chunk in stream:
        if args.json:
            pieces.append(chunk.text)
        else:
            print(chunk.text, end="", flush=True)
        if chunk.token is not None:
            tokens.append(chunk.token)
        last = chunk
    stats = last.stats.to_dict()
    if args.compare and drafter is not None:
        stats["speedup"] = _speedup(args, model, tokenizer, prompt, stats)
    if args.json:
        record = {
            "text": "".join(pieces),
            "tokens": tokens,
            "finish_reason": last.finish_reason,
            "stats": stats,
        }
        print(json.dumps(record))
    else:
        print()
        print(_summary(stats, last.stats.choices_line()), file=sys.stderr)
    return 0


def _chat_prompt(tokenizer, prompt: str, system: str | None) -> str:
    """`prompt` as the user's message in the model's chat template (as mlx_lm.generate does),
    after `system` if given; as it is when the tokenizer has no template."""
    from mlx_spec.serving.chat import chat_prompt, has_chat_template

    if not has_chat_template(tokenizer):
        return prompt
    messages = [{"role": "system", "content": system}] if system else []
    return chat_prompt(tokenizer, [*messages, {"role": "user", "content": prompt}])


def _speedup(args, model, tokenizer, prompt, stats: dict) -> float:
    """Decode tokens/s of this run over plain decoding of the same request, measured now."""
    plain = mlx_spec.generate(
        model,
        tokenizer,
        prompt,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
    ).stats
    rate = plain.decode_tokens_per_sec
    return stats["decode_tokens_per_sec"] / rate if rate else 0.0


def _summary(stats: dict, choices: str) -> str:
    line = (
        f"[{stats['generated_tokens']} tokens, {stats['decode_tokens_per_sec']:.1f} tok/s, "
        f"prefill {stats['prefill_tokens_per_sec']:.1f} tok/s"
    )
    if stats["drafter"] != "none":
        line += (
            f", drafter {stats['drafter']} k={stats['num_draft']}, acceptance "
            f"{stats['acceptance_rate']:.2f}, mean accepted length "
            f"{stats['mean_accepted_length']:.2f}"
        )
        if stats["num_draft"] == "auto":
            line += f"; {choices}"
    if "speedup" in stats:
        line += f", speedup {stats['speedup']:.2f}x over plain decoding"
    if stats.get("world_size", 1) > 1:
        line += (
            f"; {stats['world_size']} ranks, communication ~"
            f"{stats['comm_seconds_per_pass'] * 1e3:.2f} ms per target pass"
        )
    return line + "]"


def cmd_info(args) -> int:
    import mlx.core as mx

    try:
        from importlib.metadata import version

        mlx_lm_version = version("mlx-lm")
    except Exception:  # metadata missing in odd installs; not worth failing info for
        mlx_lm_version = "unknown"
    rows = {
        "mlx-spec": mlx_spec.__version__,
        "mlx": mx.__version__,
        "mlx-lm": mlx_lm_version,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "device": str(mx.default_device()),
        "blas": _blas.describe(),
        "dtype on this device": "float32" if mx.default_device() == mx.cpu else "checkpoint's",
    }
    width = max(map(len, rows))
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")
    _blas.warn_if_slow()
    return 0


def _add_convert(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint or a GGUF file into an MLX model directory",
        description="Convert a Hugging Face checkpoint (hub id or local directory) or a GGUF "
        "file (local, or --gguf FILE of a hub repo) into an MLX "
        "directory that mlx_spec.load and mlx_lm.load open. GGUF: Q4_0, Q4_1 and Q8_0 "
        "tensors stay quantized (exactly), other quantized types are dequantized to float16, "
        "--dtype turns every tensor into that float type. MTP layers that mlx-lm drops are "
        "written beside the target as a drafter directory (<mlx-path>/mtp). Output is written "
        "to a temporary directory and renamed only when complete.",
    )
    p.add_argument(
        "--hf-path",
        required=True,
        help="hub id (org/name), local directory, or local .gguf file (llama.cpp's format)",
    )
    p.add_argument(
        "--gguf",
        metavar="FILE",
        help="convert this GGUF file of the hub repo (or local directory) --hf-path",
    )
    p.add_argument("--mlx-path", required=True, help="output directory")
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        help="weight dtype (default: the checkpoint's; GGUF: every tensor, quantized ones "
        "included, dequantized to it)",
    )
    p.add_argument("-q", "--quantize", action="store_true", help="quantize linear weights")
    p.add_argument("--q-bits", type=int, default=4, help="bits per weight (default 4)")
    p.add_argument("--q-group-size", type=int, default=64, help="group size (default 64)")
    p.add_argument("--revision", help="hub revision (branch, tag or commit)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args) -> int:
    from convert import Quantization, convert_checkpoint

    quant = Quantization(args.q_bits, args.q_group_size) if args.quantize else None
    result = convert_checkpoint(
        args.hf_path,
        args.mlx_path,
        dtype=args.dtype,
        quantization=quant,
        force=args.force,
        revision=args.revision,
        gguf_file=args.gguf,
    )
    print(f"wrote {result.path}")
    if result.mtp_path is not None:
        print(f"wrote MTP drafter {result.mtp_path}")
    return 0


def _add_distill(sub) -> None:
    p = sub.add_parser(
        "distill",
        help="train a drafter (draft model or MTP head) for a target",
        description="Distill a drafter that matches the frozen target's next-token distribution "
        "(KL to the target's probabilities) on your text, or on text the target writes itself. "
        "Checkpoints while it trains; run the same command again to resume after an "
        "interruption. Reports held-out KL and acceptance before and after.",
    )
    p.add_argument("--model", required=True, help="target: MLX model directory")
    p.add_argument("--out", required=True, help="drafter directory to write")
    p.add_argument(
        "--kind",
        choices=KINDS,
        default="draft-model",
        help="a small draft model (default), an MTP head on the target's states, Medusa "
        "heads (a tree of guesses of the next --heads tokens from the target's states), an "
        "EAGLE-3 head (one layer over features of three target layers) or a DFlash block "
        "drafter (--layers layers drafting 7 tokens per pass)",
    )
    p.add_argument(
        "--data",
        nargs="+",
        default=[],
        metavar="PATH",
        help="text files or folders to train on (default: text the target writes)",
    )
    p.add_argument(
        "--holdout",
        nargs="+",
        default=[],
        metavar="PATH",
        help="text kept for evaluation (default: the last tenth of --data)",
    )
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help="train on the target's own answers to these chat prompts (JSON lines with "
        '"prompt", or one per line), each rendered with its chat template; the last tenth '
        "is held out",
    )
    p.add_argument(
        "--answers",
        metavar="FILE",
        help="with --prompts: where the answers are kept (default: OUT/answers.jsonl); answers "
        "already there are reused, so an interrupted run, or another drafter's, goes on",
    )
    p.add_argument(
        "--answer-tokens", type=int, default=256, help="with --prompts: tokens per answer"
    )
    p.add_argument(
        "--answer-temperatures",
        default="0,0.7",
        metavar="T,T",
        help="with --prompts: each prompt is answered once at each (default 0,0.7)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="--kind eagle3: draft over the N target tokens most frequent in the training "
        "text (a smaller, faster output head; default: the whole vocabulary)",
    )
    p.add_argument(
        "--teacher-cache",
        metavar="DIR",
        help="keep the target's answers (top tokens, features) here, to share between "
        "drafters trained on the same text and settings (default: inside --out, removed "
        "when done)",
    )
    p.add_argument(
        "--teacher-layers",
        default="",
        metavar="I,J",
        help="with --teacher-cache: also keep these target layers' features (Hugging Face "
        "hidden_states ids, the last: the final state), for a drafter trained next",
    )
    p.add_argument(
        "--generate-tokens",
        type=int,
        default=50_000,
        help="without --data: tokens the target writes to train on (default 50000)",
    )
    p.add_argument(
        "--target-tokens",
        type=int,
        default=0,
        metavar="N",
        help="with --data: also train on about N tokens of the target's own continuations "
        "of windows of the data, half greedy and half sampled at temperature 1, so the "
        "drafter learns what the target itself writes (default 0)",
    )
    p.add_argument(
        "--target-batch",
        type=int,
        default=16,
        metavar="ROWS",
        help="with --target-tokens: rows the target continues at once (default 16; a GPU "
        "writes them much faster with 256)",
    )
    p.add_argument(
        "--init",
        metavar="DIR",
        help="train this drafter further (a directory distill or convert wrote; its size "
        "flags are taken from it) instead of starting from scratch",
    )
    defaults = DistillConfig()
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--lr", type=float, default=defaults.learning_rate, help="peak learning rate")
    p.add_argument(
        "--hidden-size", type=int, default=defaults.hidden_size, help="draft model width"
    )
    p.add_argument(
        "--layers", type=int, default=defaults.num_layers, help="draft model or DFlash depth"
    )
    p.add_argument(
        "--mtp-family",
        choices=("mimo", "deepseek_v3", "qwen3_5"),
        default=defaults.mtp_family,
        help="layout an MTP head is stored in",
    )
    p.add_argument(
        "--heads", type=int, default=defaults.heads, help="Medusa heads (default %(default)s)"
    )
    p.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--force", action="store_true", help="overwrite a finished output directory")
    p.set_defaults(func=cmd_distill)


def cmd_distill(args) -> int:
    from mlx_spec.training.distill import ChatData, run_distill

    config = DistillConfig(
        kind=args.kind,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        learning_rate=args.lr,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        mtp_family=args.mtp_family,
        heads=args.heads,
    )
    chat = None
    if args.prompts:
        if args.data:
            raise ValueError("--prompts and --data are two sources of text: give one")
        temperatures = tuple(float(t) for t in args.answer_temperatures.split(","))
        answers = args.answers or os.path.join(args.out, "answers.jsonl")
        chat = ChatData(args.prompts, answers, temperatures, args.answer_tokens)
    if args.draft_vocab is not None and args.kind != "eagle3":
        raise ValueError(
            "--draft-vocab sizes an EAGLE-3 head's vocabulary: use it with --kind eagle3"
        )
    _blas.warn_if_slow()
    report = run_distill(
        args.model,
        args.out,
        config,
        data_paths=tuple(args.data),
        holdout_paths=tuple(args.holdout),
        generate=args.generate_tokens,
        target_tokens=args.target_tokens,
        target_batch=args.target_batch,
        init=args.init,
        force=args.force,
        chat=chat,
        draft_vocab=args.draft_vocab,
        teacher_cache=args.teacher_cache,
        teacher_layers=tuple(int(i) for i in args.teacher_layers.split(",") if i.strip()),
    )
    before, after = report["before"] or {}, report["after"]
    for key in after:
        was = f"{before[key]:.3f} -> " if key in before else ""
        print(f"{key}: {was}{after[key]:.3f}")
    flag = {"mtp": "--mtp", "medusa": "--medusa", "eagle3": "--eagle", "dflash": "--dflash"}.get(
        args.kind, "--draft-model"
    )
    print(
        f"wrote {args.out}; use it with: mlx-spec generate --model {args.model} {flag} {args.out}"
    )
    return 0


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure tokens/s of every decoding mode, with mlx-lm's speculative decoding beside",
        description="A/B benchmark: plain decoding, each drafter (draft model, n-gram, MTP) "
        "over a sweep of k and with k chosen every round ('auto'; also all drafters as one "
        "group: mode 'all'), greedy and temperature 1.0, and mlx-lm's own speculative "
        "decoding with the same draft model, on the same prompts and settings (EOS off, "
        "same seeds). Reports decode tokens/s, speedup over plain, acceptance (by draft "
        "position), mean accepted length, target passes per token, per-token latency "
        "p50/p95, prefill tokens/s, peak memory, time in rollback, the k chosen by 'auto', "
        "and the analytic speedup bound from the measured acceptance and costs. Warm-up, "
        "interleaved repeats, medians. Without --model: the embedded demo pair on held-out "
        "standard-library code.",
    )
    p.add_argument("--model", help="target: MLX model directory or hub id (default: the demo pair)")
    p.add_argument(
        "--draft-model", help="draft model for draft-model and mlx-lm modes (default: the pair's)"
    )
    p.add_argument(
        "--mtp",
        nargs="?",
        const="",
        metavar="DIR",
        help="MTP drafter directory (default: MODEL/mtp when it exists)",
    )
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help='prompts, one per line or JSON lines {"prompt": ...} (default: the first '
        "--prompt-tokens tokens of each held-out standard-library file)",
    )
    p.add_argument("--max-tokens", type=int, help="tokens generated per prompt (default 128)")
    p.add_argument("--prompt-tokens", type=int, help="length of the built-in prompts (128)")
    p.add_argument("--num-prompts", type=int, help="use only the first N prompts")
    p.add_argument(
        "--modes",
        help="comma-separated subset of plain,draft-model,ngram,mtp,eagle3,dflash,all,mlx-lm "
        "(default: "
        "all); "
        "tree modes, run only when named: medusa,lookahead,draft-tree,mtp-tree,eagle3-tree",
    )
    p.add_argument("--num-draft", help="k sweep, comma-separated (default 1,2,4,8)")
    p.add_argument(
        "--max-draft", type=int, help="K of the 'auto' rows, which choose k in 0..K (default 8)"
    )
    p.add_argument("--no-auto", action="store_true", help="skip the 'auto' rows")
    p.add_argument("--temperatures", help="comma-separated (default 0,1.0)")
    p.add_argument("--repeats", type=int, help="measured repeats; medians reported (default 3)")
    p.add_argument("--seed", type=int, help="base seed (default 0)")
    p.add_argument("--no-peer", action="store_true", help="skip mlx-lm's speculative decoding")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a run of a few minutes: 3 prompts, 64 tokens, k 2,4, 2 repeats",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    _add_shard_flag(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from pathlib import Path

    from mlx_spec.bench import harness as bench

    overrides = {
        "model": args.model,
        "draft_model": args.draft_model,
        "mtp": args.mtp,
        "prompts_file": args.prompts,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "num_prompts": args.num_prompts,
        "repeats": args.repeats,
        "seed": args.seed,
        "modes": bench.parse_modes(args.modes) if args.modes is not None else None,
        "num_draft": bench.parse_int_list(args.num_draft) if args.num_draft is not None else None,
        "max_draft": args.max_draft,
        "temperatures": (
            bench.parse_float_list(args.temperatures) if args.temperatures is not None else None
        ),
    }
    _check_shard(args.shard, args.group)
    if args.group is not None:
        overrides["shard"] = args.shard or "auto"
    config = bench.BenchConfig.preset(
        quick=args.quick,
        peer=not args.no_peer,
        auto=not args.no_auto,
        **{key: value for key, value in overrides.items() if value is not None},
    )
    config.validate()
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise FileNotFoundError(f"--json {args.json}: no such directory")
    _blas.warn_if_slow()
    report = bench.run_bench(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.to_markdown())
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _add_drafter_flags(p) -> None:
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
    p.add_argument(
        "--num-draft",
        type=_num_draft,
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


def _add_shard_flag(p) -> None:
    p.add_argument(
        "--shard",
        choices=("auto", "tensor", "pipeline"),
        default=None,
        help="under a distributed launcher (mlx.launch --backend ring|jaccl|mpi -n N ...): how "
        "the target is split over the ranks; 'auto' (default there) picks tensor parallelism "
        "where the architecture has it, else pipeline stages. Rank 0 prints; the drafter is "
        "replicated on every rank",
    )


def _load_target(args):
    """The target of `args.model`: split over the ranks when launched distributed."""
    group = getattr(args, "group", None)
    shard = getattr(args, "shard", None)
    _check_shard(shard, group)
    if group is None:
        return mlx_spec.load(args.model)
    return mlx_spec.load(args.model, shard=shard or "auto", group=group)


def _check_shard(shard: str | None, group) -> None:
    if shard is not None and group is None:
        raise ValueError(
            "--shard splits the target over the ranks of a distributed launch: start the "
            "command with mlx.launch (e.g. mlx.launch --backend ring -n 2 mlx-spec generate ...)"
        )


def _num_draft(text: str) -> int | str:
    """An integer, or the text as given ('auto'; anything else is refused by the library
    with a one-line error)."""
    try:
        return int(text)
    except ValueError:
        return text


def _add_sampling_flags(p) -> None:
    """Sampling settings shared by generate and chat."""
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filter (0 = off)")


def _add_chat(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a model, speculatively, reusing the prompt cache across turns",
        description="A streaming conversation using the model's chat template (or a plain "
        "User:/Assistant: transcript). Each turn prefills only the new tokens: the caches of "
        "target and drafter carry over. Reads lines from standard input; /stats, /reset, "
        "/help, /quit. Ctrl-C stops a reply, not the conversation.",
    )
    p.add_argument(
        "--model",
        help="target: MLX model directory or hub id (default: the embedded demo pair, with its "
        "three drafters chosen between every round)",
    )
    _add_drafter_flags(p)
    _add_shard_flag(p)
    _add_sampling_flags(p)
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per reply (default 512)")
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    from mlx_spec.serving.chat import Chat, input_lines
    from mlx_spec.serving.session import Session

    _blas.warn_if_slow()
    _model_defaults(args, default=DEFAULT_ASSISTANT)
    model, tokenizer = _load_target(args)
    session = Session(
        model,
        tokenizer,
        drafter=_drafter(args, model),
        num_draft=args.num_draft,
        max_draft=args.max_draft,
    )
    sampling = dict(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    if args.seed is not None:
        import mlx.core as mx

        mx.random.seed(args.seed)
    chat = Chat(session, system=args.system, max_tokens=args.max_tokens, sampling=sampling)
    chat.check_settings()
    lines = input_lines(sys.stdin)
    if getattr(args, "group", None) is not None:  # rank 0 reads; every rank gets its lines
        from mlx_spec.decoding.distributed import shared_lines

        lines = shared_lines(args.group, lines)
    return chat.run(lines)


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API (chat/completions, completions, models)",
        description="An OpenAI-compatible HTTP server with speculative decoding: "
        "/v1/chat/completions, /v1/completions (streaming or not), /v1/models, /health. "
        "Requests choose speculation with the extra field "
        '"speculative": {"enabled": true, "drafter": "ngram", "num_draft": 4}; '
        "usage.speculative reports acceptance and speed. Under mlx.launch the target is "
        "split over the ranks (--shard); rank 0 answers HTTP and the others follow its "
        "batches.",
    )
    p.add_argument(
        "--model",
        help="target: MLX model directory or hub id (default: the embedded demo pair; requests "
        "draft with all its drafters, chosen between every round, unless they say otherwise)",
    )
    _add_drafter_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("MLX_SPEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $MLX_SPEC_API_KEY, else none)",
    )
    p.add_argument("--model-id", help="the model name clients send (default: the directory name)")
    p.add_argument(
        "--max-tokens-limit", type=int, default=4096, help="largest max_tokens (default 4096)"
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=1 << 20, help="largest body (default 1 MiB)"
    )
    p.add_argument(
        "--max-concurrent", type=int, default=8, help="generations advanced together (default 8)"
    )
    p.add_argument(
        "--max-queued", type=int, default=256, help="requests waiting at most (default 256)"
    )
    p.add_argument(
        "--prompt-cache-bytes",
        type=_byte_count,
        default=2 << 30,
        metavar="BYTES",
        help="memory for the caches of finished requests, reused by later requests that share "
        "their prefix (a conversation's next turn prefills only its new tokens); K/M/G "
        "suffixes, 0 turns the prompt cache off (default 2G)",
    )
    p.add_argument(
        "--max-kv-bytes",
        type=_byte_count,
        default=None,
        metavar="BYTES",
        help="cache memory the batched requests may reserve (prompt + max_tokens each): more "
        "requests wait, one that alone needs more is refused; K/M/G suffixes (default: 40%% "
        "of the device's memory)",
    )
    p.add_argument(
        "--pace-slack",
        type=_pace_slack,
        default=None,
        metavar="SHARE",
        help="how far behind plain decoding's pace speculation inside a batch may put a "
        "request, as a share of its decoding time, e.g. 0.02: a request whose drafts fail is "
        "not slowed further for the batch's sake once that far behind, at some cost to the "
        "batch's throughput (default: off, the batch's throughput alone decides)",
    )
    p.add_argument(
        "--trace-steps",
        metavar="FILE",
        help="append each step of the batch engine to FILE as a JSON line (rows, drafts, the "
        "drafters, where its milliseconds went, the policy's reason): why speculation pays "
        "or not under your load; `mlx-spec steps FILE` summarises it",
    )
    p.add_argument(
        "--no-batching",
        action="store_true",
        help="advance requests one after another in turn instead of batching them",
    )
    p.add_argument(
        "--prefill-step",
        type=int,
        default=256,
        metavar="N",
        help="prefill prompts N tokens at a time, letting the other streams take a step "
        "between chunks (default 256)",
    )
    p.add_argument(
        "--prompt-cache-entries",
        type=int,
        default=32,
        metavar="N",
        help="finished requests' caches kept at most (default 32)",
    )
    _add_shard_flag(p)
    p.set_defaults(func=cmd_serve)


def _byte_count(text: str) -> int:
    from mlx_spec.caches.prompt_cache import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pace_slack(text: str) -> float | None:
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1) or 'off', got {text!r}")
    return value


def _trace_file(path: str | None, no_batching: bool) -> str | None:
    """`--trace-steps`: a file the server can append to (checked before the model loads)."""
    if path is None:
        return None
    if no_batching:
        raise ValueError("--trace-steps traces the batch engine's steps: drop --no-batching")
    try:
        open(path, "a").close()
    except OSError as exc:
        raise ValueError(f"--trace-steps: cannot write {path}: {exc.strerror}") from None
    return path


def freeze_loaded() -> None:
    """Keep what a long-running command has loaded (the model, the libraries: some 240,000
    objects) out of the garbage collector's full passes: each of them would otherwise scan
    it all, 60-100 ms on a 2-core x86 in which the engine holds every stream."""
    gc.collect()
    gc.freeze()


def cmd_serve(args) -> int:
    from mlx_spec.serving.server import ServerConfig, create_app, drafter_factories, follow

    import uvicorn

    group = getattr(args, "group", None)
    for name in ("max_tokens_limit", "max_request_bytes", "max_concurrent", "port", "prefill_step"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    trace_steps = _trace_file(args.trace_steps, args.no_batching)
    _blas.warn_if_slow()
    named_model = args.model or DEFAULT_ASSISTANT
    _model_defaults(args, default=DEFAULT_ASSISTANT)
    model, tokenizer = _load_target(args)
    mtp = None if args.mtp is None else (args.mtp or args.model)
    drafters = drafter_factories(
        model, tokenizer, draft_model=args.draft_model, mtp=mtp, assistant=args.assistant,
        eagle=args.eagle, dflash=args.dflash,
    )  # fmt: skip
    flags = [("draft-model", args.draft_model), ("ngram", args.ngram), ("mtp", mtp),
             ("gemma4-assistant", args.assistant), ("eagle3", args.eagle),
             ("dflash", args.dflash)]  # fmt: skip
    named = [name for name, flag in flags if flag]
    default = "all" if len(named) > 1 else (named[0] if named else None)
    config = ServerConfig(
        model_id=args.model_id or os.path.basename(os.path.normpath(named_model)),
        api_key=args.api_key,
        max_tokens_limit=args.max_tokens_limit,
        max_request_bytes=args.max_request_bytes,
        max_concurrent=args.max_concurrent,
        max_queued=args.max_queued,
        default_drafter=default,
        num_draft=args.num_draft,
        max_draft=args.max_draft,
        prompt_cache_bytes=args.prompt_cache_bytes,
        prompt_cache_entries=max(args.prompt_cache_entries, 0),
        prefill_step=args.prefill_step,
        batching=not args.no_batching,
        max_kv_bytes=args.max_kv_bytes or None,
        pace_slack=args.pace_slack,
        trace_steps=trace_steps,
    )
    if group is not None and group.rank() != 0:  # rank 0 answers; this rank runs its turns
        freeze_loaded()
        follow(model, tokenizer, config, drafters)
        return 0
    app = create_app(model, tokenizer, config, drafters)
    freeze_loaded()
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(
            f"mlx-spec: warning: serving on {args.host} without --api-key: anyone who can "
            "reach this address can use the model",
            file=sys.stderr,
        )
    print(
        f"mlx-spec: serving {config.model_id!r} at http://{args.host}:{args.port}/v1 "
        f"(drafters: {', '.join(sorted(drafters))}; default: {default or 'none'})",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _quiet_third_parties() -> None:
    """The command prints its own output only: transformers' notices (long-text tokenizer
    warnings, deprecated config keys) are not about anything the user did."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers comes with mlx-lm
        return
    hf_logging.set_verbosity_error()


def _add_steps(sub) -> None:
    from mlx_spec.bench import step_timeline

    p = sub.add_parser(
        "steps",
        help="summarise a server's step trace (serve --trace-steps FILE)",
        description=step_timeline.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    step_timeline.add_arguments(p)
    p.set_defaults(func=step_timeline.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-spec",
        description="Lossless speculative decoding on MLX.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_convert(sub)
    _add_distill(sub)
    _add_bench(sub)
    _add_chat(sub)
    _add_serve(sub)
    _add_steps(sub)
    info = sub.add_parser("info", help="versions, device and the BLAS MLX uses")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    from mlx_spec.decoding import distributed

    args = build_parser().parse_args(argv)
    _quiet_third_parties()
    args.group = None
    code = _main(args)
    if args.group is not None:  # a launched rank: out without tearing the group down
        distributed.leave(code)
    return code


def _main(args) -> int:
    from mlx_spec.decoding import distributed

    try:
        if args.command not in ("info", "steps"):
            args.group = distributed.world()
        distributed.quiet_other_ranks(args.group)
        if args.group is not None:
            distributed.stop_on_signal()
            distributed.watch_for_lost_ranks(args.group.rank())
            if args.command in ("convert", "distill"):
                raise ValueError(f"{args.command} runs on one machine: start it without mlx.launch")
        return args.func(args)
    except distributed.DistributedError as exc:
        _error(args, exc)
        return 1
    except RuntimeError as exc:
        if not distributed.lost_peer(exc):
            raise
        _error(args, f"a rank of the distributed run was lost ({exc})")
        return 1
    except KeyboardInterrupt:
        print("\nmlx-spec: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, OSError) as exc:
        _error(args, exc)
        return 2


def _error(args, message) -> None:
    """One line on standard error; in a distributed run it names the rank, and the other
    ranks' errors reach the terminal though the rest of their output does not."""
    group = getattr(args, "group", None)
    if group is None:
        print(f"mlx-spec: error: {message}", file=sys.stderr)
        return
    stream = sys.stderr if group.rank() == 0 else sys.__stderr__
    print(f"mlx-spec: error: rank {group.rank()}: {message}", file=stream, flush=True)


if __name__ == "__main__":
    sys.exit(main())
