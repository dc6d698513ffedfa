"""Acceptance and speedup of each drafter of the embedded pair on held-out standard-library files.

For every held-out file the first PROMPT tokens are the prompt; each mode generates the same
number of tokens with the same settings (greedy and temperature 1.0). Speedups are ratios of
decode tokens/s to plain decoding measured in the same run.

    python benchmarks/embedded_pair.py --json benchmarks/results/embedded_pair.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path

import mlx_spec
from mlx_spec import _blas
from mlx_spec.embedded import converted_pair, stdlib_files

import mlx.core as mx


def modes(target, draft_dir: Path):
    """(name, drafter factory, k) of every configuration measured."""
    draft = mlx_spec.load_drafter(str(draft_dir))
    return [
        ("plain", lambda: None, 0),
        ("draft-model", lambda: draft, 4),
        ("mtp", lambda: "mtp", 2),
        ("ngram", lambda: "ngram", 4),
    ]


def prompts(tokenizer, length: int) -> list[list[int]]:
    out = []
    for path in stdlib_files()[1]:
        ids = tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)
        out.append(ids[:length])
    return out


def run_mode(model, tokenizer, drafter_factory, k, prompt_ids, temperature, max_tokens) -> dict:
    accepted = drafted = passes = tokens = 0
    seconds = 0.0
    for i, ids in enumerate(prompt_ids):
        stats = mlx_spec.generate(
            model,
            tokenizer,
            ids,
            drafter=drafter_factory(),
            num_draft=k,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=i,
        ).stats
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
        passes, tokens = passes + stats.target_passes, tokens + stats.generated_tokens
        seconds += stats.decode_seconds
    return {
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": tokens / passes if passes else 0.0,
        "tokens_per_sec": tokens / seconds if seconds else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode; medians reported")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    target_dir, draft_dir = converted_pair()
    model, tokenizer = mlx_spec.load(str(target_dir))
    tokenizer = copy.copy(tokenizer)
    tokenizer.eos_token_ids = set()  # the same number of tokens in every mode
    ids = prompts(tokenizer, args.prompt_tokens)
    print(
        f"device {mx.default_device()}, BLAS {_blas.describe()}, float32, "
        f"{len(ids)} held-out files, {args.max_tokens} tokens each"
    )
    results = []
    for temperature in (0.0, 1.0):
        table = {}
        for name, factory, k in modes(model, draft_dir):
            runs = [
                run_mode(model, tokenizer, factory, k, ids, temperature, args.max_tokens)
                for _ in range(args.repeats)
            ]
            table[name] = {
                **runs[0],
                "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in runs),
                "num_draft": k,
            }
        for name, row in table.items():
            row["speedup"] = row["tokens_per_sec"] / table["plain"]["tokens_per_sec"]
            results.append({"mode": name, "temperature": temperature, **row})
    print("| mode | k | temperature | acceptance | mean accepted length | tokens/s | speedup |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        print(
            f"| {r['mode']} | {r['num_draft']} | {r['temperature']} | {rate} | "
            f"{r['mean_accepted_length']:.2f} | {r['tokens_per_sec']:.1f} | "
            f"{r['speedup']:.2f}x |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results}, indent=2))


if __name__ == "__main__":
    main()
