"""Plain-decoding overhead of mlx-spec against mlx-lm on the same model and prompt.

Measures `mlx_spec.stream_generate(model, tokenizer, prompt, max_tokens=N)` (no drafter) against
`mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=N)` (greedy default sampler) in one
process, interleaving the two (A B A B ...) after warm-up runs, and reports the median decode
tokens/s of each and their ratio (mlx-spec / mlx-lm). The acceptance bar is ratio >= 0.97.

Decode tokens/s is computed here, identically for both libraries, from wall-clock timestamps
taken as each token's chunk arrives: (tokens - 1) / (t_last_token - t_first_token). Prefill and
time to first token are excluded (and reported separately). Neither library's own tokens/s field
is used for the verdict. Also reported, to judge noise: the median of per-pair ratios, and a
ratio from each run's median token interval (robust to bursts of load from other processes).
On a shared 2-core machine single runs vary by +-30%, so 7 pairs resolve 3% only when the
machine is quiet; use `--runs 30` for a firmer verdict.

By default a random llama checkpoint (~29M parameters, float32: hidden 512, 8 layers,
intermediate 1536, 8 heads / 4 KV heads) is written to a temporary directory, with a byte-level
BPE tokenizer of exactly 4096 tokens trained on the running interpreter's standard library
sources, so the model's vocabulary equals the tokenizer's (no padded rows). EOS is disabled on
a copy of the tokenizer so both libraries generate exactly N tokens, and both must produce
identical token ids (greedy decoding).

Examples:
    python benchmarks/plain_overhead.py                 # full run: 7 pairs x 128 tokens
    python benchmarks/plain_overhead.py --quick         # 3 pairs x 32 tokens
    python benchmarks/plain_overhead.py --json out.json --strict
    python benchmarks/plain_overhead.py --model path/to/mlx-model
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import mlx_spec  # first: loads the optimized BLAS before anything imports mlx
from mlx_spec.bench.harness import machine_info, model_dtype, param_count
from mlx_spec.platform import blas as _blas

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generation_stream

_TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"

THRESHOLD = 0.97
DEFAULT_PROMPT = (
    "def read_config(path):\n"
    '    """Read a configuration file and return a dictionary of its settings."""\n'
    "    with open(path) as handle:\n"
)
MODEL_SHAPE = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}
VOCAB_SIZE = 4096
CORPUS_CHARS = 3_000_000


def _tinymodels():
    """The tests' checkpoint helpers (tests/tinymodels.py), imported via sys.path."""
    if str(_TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(_TESTS_DIR))
    import tinymodels

    return tinymodels


def _stdlib_corpus(max_chars: int):
    """Python sources of the running interpreter's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        total += len(text)
        if total >= max_chars:
            return


def build_bpe_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens; ids 0-2 are <unk>, <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tm = _tinymodels()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=tm.SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_stdlib_corpus(CORPUS_CHARS), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"BPE training gave {tok.get_vocab_size()} tokens, wanted {vocab_size}: "
            "the corpus is too small"
        )
    return tok


def write_random_model(path: Path, seed: int) -> dict:
    """Write a random float32 llama checkpoint with a 4096-token BPE tokenizer to `path`."""
    tm = _tinymodels()
    tokenizer = build_bpe_tokenizer(VOCAB_SIZE)
    config = tm.llama_config(VOCAB_SIZE, **MODEL_SHAPE)
    weights = tm.random_weights(config, seed=seed)
    tm.write_checkpoint(path, config, weights, tokenizer)
    return config


def _settle() -> None:
    """Finish any work still queued (mlx-lm's pipelined step runs one token ahead) and collect
    garbage, so one run does not spill into the next."""
    mx.synchronize(generation_stream)
    mx.synchronize()
    gc.collect()


def _summarize(stamps: list[float], start: float, tokens: list[int]) -> dict:
    n = len(tokens)
    decode_s = stamps[-1] - stamps[0] if n > 1 else 0.0
    gaps = [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)]
    return {
        "tokens": tokens,
        "num_tokens": n,
        "ttft_s": stamps[0] - start if n else 0.0,
        "decode_s": decode_s,
        "decode_tps": (n - 1) / decode_s if decode_s > 0 else 0.0,
        "total_s": stamps[-1] - start if n else 0.0,
        # Secondary, robust to bursts of load from other processes: the median token interval.
        "median_gap_tps": 1.0 / statistics.median(gaps) if gaps else 0.0,
    }


def run_mlx_spec(model, tokenizer, prompt: str, max_tokens: int) -> dict:
    """One plain (no drafter) mlx-spec generation; a timestamp per token-carrying chunk."""
    _settle()
    stamps, tokens, reported = [], [], None
    start = time.perf_counter()
    for chunk in mlx_spec.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        now = time.perf_counter()
        if chunk.token is not None:
            stamps.append(now)
            tokens.append(chunk.token)
        else:
            reported = chunk.stats
    out = _summarize(stamps, start, tokens)
    out["prompt_tokens"] = reported.prompt_tokens
    out["library_reported_tps"] = reported.decode_tokens_per_sec
    return out


def run_mlx_lm(model, tokenizer, prompt: str, max_tokens: int) -> dict:
    """One mlx-lm generation; every response carries a token (the last one in the final
    response, which also has finish_reason set)."""
    _settle()
    stamps, tokens, last = [], [], None
    start = time.perf_counter()
    for response in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        stamps.append(time.perf_counter())
        tokens.append(int(response.token))
        last = response
    out = _summarize(stamps, start, tokens)
    out["prompt_tokens"] = last.prompt_tokens
    out["library_reported_tps"] = last.generation_tps
    return out


RUNNERS = {"mlx-spec": run_mlx_spec, "mlx-lm": run_mlx_lm}


def benchmark(model, tokenizer, prompt: str, max_tokens: int, runs: int, warmup: int) -> dict:
    """Warm-up pairs, then `runs` interleaved A/B pairs; checks the outputs agree."""
    reference = None
    results = {name: [] for name in RUNNERS}
    for i in range(warmup + runs):
        for name, fn in RUNNERS.items():
            res = fn(model, tokenizer, prompt, max_tokens)
            if res["num_tokens"] != max_tokens:
                raise SystemExit(
                    f"error: {name} generated {res['num_tokens']} tokens, expected {max_tokens}"
                )
            if reference is None:
                reference = res
            elif res["tokens"] != reference["tokens"]:
                first = next(
                    j
                    for j, (a, b) in enumerate(zip(res["tokens"], reference["tokens"], strict=True))
                    if a != b
                )
                raise SystemExit(
                    f"error: {name} token ids differ from the first (mlx-spec warm-up) run at "
                    f"position {first}: greedy outputs must be identical"
                )
            if res["prompt_tokens"] != reference["prompt_tokens"]:
                raise SystemExit("error: the two libraries encoded the prompt differently")
            phase = "warm-up" if i < warmup else f"run {i - warmup + 1}/{runs}"
            print(
                f"  {phase:>9} {name:>8}: {res['decode_tps']:8.2f} tok/s decode, "
                f"ttft {res['ttft_s'] * 1e3:7.1f} ms",
                flush=True,
            )
            if i >= warmup:
                results[name].append(res)
    return {
        "results": results,
        "tokens": reference["tokens"],
        "prompt_tokens": reference["prompt_tokens"],
    }


def summarize(results: dict) -> dict:
    spec, lm = results["mlx-spec"], results["mlx-lm"]
    out = {}
    for name, runs in results.items():
        tps = [r["decode_tps"] for r in runs]
        out[name] = {
            "decode_tps_median": statistics.median(tps),
            "decode_tps_runs": tps,
            "decode_tps_min": min(tps),
            "decode_tps_max": max(tps),
            "ttft_ms_median": statistics.median(r["ttft_s"] for r in runs) * 1e3,
            "ms_per_token_median": 1e3 / statistics.median(tps),
            "median_gap_tps_median": statistics.median(r["median_gap_tps"] for r in runs),
            "library_reported_tps_median": statistics.median(
                r["library_reported_tps"] for r in runs
            ),
        }
    out["ratio"] = out["mlx-spec"]["decode_tps_median"] / out["mlx-lm"]["decode_tps_median"]
    pair_ratios = [a["decode_tps"] / b["decode_tps"] for a, b in zip(spec, lm, strict=True)]
    out["pair_ratios"] = pair_ratios
    out["pair_ratio_median"] = statistics.median(pair_ratios)
    out["median_gap_ratio"] = (
        out["mlx-spec"]["median_gap_tps_median"] / out["mlx-lm"]["median_gap_tps_median"]
    )
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Compare plain decoding (no drafter) of mlx_spec.stream_generate with "
            "mlx_lm.stream_generate on the same model and prompt. Runs are interleaved "
            "(mlx-spec, mlx-lm, mlx-spec, mlx-lm, ...) after warm-up; decode tokens/s is "
            "(tokens - 1) / (time of last token - time of first token), measured here from "
            "wall-clock timestamps of the streamed chunks (prefill excluded). Reports the "
            "medians and the ratio mlx-spec / mlx-lm, with PASS when the ratio is >= "
            f"{THRESHOLD}. Without --model a random ~29M-parameter float32 llama checkpoint with "
            "a 4096-token byte-level BPE tokenizer is written to a temporary directory."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        help="an existing MLX model directory (loaded with mlx_spec.load: float32 on CPU); "
        "default: write a random llama checkpoint to a temp dir",
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    parser.add_argument(
        "--max-tokens", type=int, help="tokens generated per run (default 128, 32 with --quick)"
    )
    parser.add_argument(
        "--runs", type=int, help="measured runs per library (default 7, 3 with --quick)"
    )
    parser.add_argument(
        "--warmup", type=int, help="unmeasured warm-up runs per library (default 2, 1 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random checkpoint")
    parser.add_argument(
        "--threshold", type=float, default=THRESHOLD, help="acceptance bar for the ratio"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 when the ratio is below the bar"
    )
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (32 if args.quick else 128)
    args.runs = args.runs or (3 if args.quick else 7)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.max_tokens < 2 or args.runs < 1 or args.warmup < 0:
        parser.error("need --max-tokens >= 2, --runs >= 1, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    _blas.warn_if_slow()
    with tempfile.TemporaryDirectory(prefix="mlx-spec-bench-") as tmp:
        if args.model:
            model_path, model_note = args.model, f"{args.model}"
        else:
            model_path = os.path.join(tmp, "random-llama")
            tic = time.perf_counter()
            write_random_model(Path(model_path), args.seed)
            model_note = (
                f"random llama (seed {args.seed}, {MODEL_SHAPE['hidden_size']} hidden, "
                f"{MODEL_SHAPE['num_hidden_layers']} layers, "
                f"{MODEL_SHAPE['intermediate_size']} intermediate), written in "
                f"{time.perf_counter() - tic:.1f} s"
            )
        model, tokenizer = mlx_spec.load(model_path)
    tokenizer = copy.copy(tokenizer)
    tokenizer.eos_token_ids = set()  # no EOS: both generate exactly max_tokens
    tok_vocab = len(tokenizer.get_vocab())
    model_vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    vocab_note = f"tokenizer {tok_vocab} tokens, model vocab {model_vocab}" + (
        "" if model_vocab in (None, tok_vocab) else " (padded: mlx-spec cuts logits)"
    )
    header = {
        **machine_info(),
        "dtype": model_dtype(model),
        "parameters": param_count(model),
        "model": model_note,
        "vocab": vocab_note,
        "detokenizer": type(tokenizer.detokenizer).__name__,
        "max_tokens": args.max_tokens,
        "runs": args.runs,
        "warmup": args.warmup,
    }
    print("plain decoding: mlx-spec vs mlx-lm")
    for key, value in header.items():
        print(f"  {key:>12}: {value}")
    bench = benchmark(model, tokenizer, args.prompt, args.max_tokens, args.runs, args.warmup)
    header["prompt_tokens"] = bench["prompt_tokens"]
    summary = summarize(bench["results"])
    passed = summary["ratio"] >= args.threshold
    spec, lm = summary["mlx-spec"], summary["mlx-lm"]
    print(f"prompt {bench['prompt_tokens']} tokens; outputs identical ({args.max_tokens} tokens)")
    for name, s in (("mlx-spec", spec), ("mlx-lm", lm)):
        print(
            f"  {name:>8}: median {s['decode_tps_median']:8.2f} tok/s "
            f"({s['ms_per_token_median']:.2f} ms/token; min {s['decode_tps_min']:.2f}, "
            f"max {s['decode_tps_max']:.2f}; from median interval "
            f"{s['median_gap_tps_median']:.2f}), ttft {s['ttft_ms_median']:.1f} ms"
        )
    print(
        f"  ratio mlx-spec / mlx-lm: {summary['ratio']:.4f} (median of pairs "
        f"{summary['pair_ratio_median']:.4f}; from median token intervals "
        f"{summary['median_gap_ratio']:.4f})"
    )
    print(f"{'PASS' if passed else 'FAIL'}: ratio {summary['ratio']:.4f} vs bar {args.threshold}")
    if args.json:
        record = {
            "benchmark": "plain_overhead",
            "header": header,
            "prompt": args.prompt,
            "threshold": args.threshold,
            "passed": passed,
            **summary,
            "tokens": bench["tokens"],
        }
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if args.strict and not passed else 0


if __name__ == "__main__":
    sys.exit(main())
