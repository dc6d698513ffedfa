"""`mlx-spec serve` against `mlx_lm.server` as a user with a plain client sees them: one server
at a time, started fresh, N streaming clients sending their completions at once, then stopped.

`server_load.py` keeps both servers up for the whole run, warms each N up before measuring and
rotates the modes within every repeat; here each repeat starts each server anew (the order
alternates between repeats) and measures the levels of `--concurrency` in the order given, the
first of them on a server that has answered nothing yet (unless `--warm-up`). Same model
(the embedded pair's target, float32 for both), same BLAS (preloaded for mlx_lm.server), ours
with the pair's draft model and the request's defaults (speculation on, draft lengths `auto`).
Prompts: the openings of the held-out files (`--prompt-chars` characters each), a different one
for every request (`--same-prompt`: one for all).

Prints, per server and N, the median throughput (completion tokens / wall time) and time to
first token over the repeats, and ours over the peer's per repeat (median and range).

    python benchmarks/plain_client.py --repeats 3 --json plain_client.json
    python benchmarks/plain_client.py --repeats 3 --warm-up
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from mlx_spec.bench.harness import machine_info

import server_load as sl


def servers(target: Path, draft: Path, peer_dir: Path, slots: int) -> dict:
    ours = [sys.executable, "-m", "mlx_spec.cli", "serve", "--model", str(target), "--model-id",
            "bench", "--draft-model", str(draft), "--max-concurrent", str(slots)]  # fmt: skip
    return {
        "mlx-spec serve": (lambda: sl.ServerProcess("mlx-spec serve", ours), "bench"),
        "mlx_lm.server": (lambda: sl.peer_server(peer_dir), "default_model"),
    }


def one_server(start, model: str, args, prompts: list[str]) -> list[dict]:
    """A fresh server: (warm-up,) each N of `--concurrency` in order, then stopped."""
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    sl.PROMPTS[:] = prompts
    rows = []
    with start() as url:
        if args.warm_up:
            sl.warm_up(url, body, args.concurrency)
        for n in args.concurrency:
            row = sl.uncollected(sl.run_load(url, n, args.requests, body))
            rows.append({key: row[key] for key in (
                "concurrency", "errors", "completion_tokens", "wall_seconds",
                "throughput_tokens_per_sec", "ttft_p50_ms", "ttft_p95_ms", "latency_p50_s",
                "acceptance_rate",
            )})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 1])
    p.add_argument("--requests", type=int, default=2, help="completions per client (default 2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warm-up", action="store_true", help="a short request per client first")
    p.add_argument("--prompt-chars", type=int, default=200)
    p.add_argument("--same-prompt", action="store_true", help="one prompt for every request")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    from mlx_spec.embedded import converted_pair, stdlib_files

    target, draft = converted_pair()
    texts = [path.read_text(errors="replace")[: args.prompt_chars] for path in stdlib_files()[1]]
    prompts = texts[:1] if args.same_prompt else texts
    runs: dict[str, list[list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        peer_dir = sl.float32_copy(target, Path(tmp) / "peer")
        named = servers(target, draft, peer_dir, max(args.concurrency))
        for repeat in range(args.repeats):
            order = list(named) if repeat % 2 == 0 else list(reversed(named))
            for name in order:
                rows = one_server(*named[name], args, prompts)
                runs.setdefault(name, []).append(rows)
                for row in rows:
                    print(f"[{repeat + 1}/{args.repeats}] {name} N={row['concurrency']}: "
                          f"{row['throughput_tokens_per_sec']:.1f} tok/s, time to first token "
                          f"p50 {row['ttft_p50_ms']:.0f} ms, acceptance "
                          f"{row['acceptance_rate']:.2f}, "
                          f"errors {row['errors']}",
                          flush=True)  # fmt: skip
    summary = []
    for i, n in enumerate(args.concurrency):
        line = {"concurrency": n}
        for name, repeats in runs.items():
            line[name] = statistics.median(r[i]["throughput_tokens_per_sec"] for r in repeats)
            line[f"{name} ttft_p50_ms"] = statistics.median(r[i]["ttft_p50_ms"] for r in repeats)
        ratios = [
            ours[i]["throughput_tokens_per_sec"] / peer[i]["throughput_tokens_per_sec"]
            for ours, peer in zip(runs["mlx-spec serve"], runs["mlx_lm.server"], strict=True)
        ]
        line["ratio_median"] = statistics.median(ratios)
        line["ratio_range"] = [min(ratios), max(ratios)]
        summary.append(line)
        print(f"N={n}: ours {line['mlx-spec serve']:.1f} tok/s, mlx_lm.server "
              f"{line['mlx_lm.server']:.1f} tok/s; ours/peer {line['ratio_median']:.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f})", flush=True)  # fmt: skip
    if args.json:
        record = {"command": " ".join(["plain_client.py", *(argv or sys.argv[1:])]),
                  **machine_info(), "summary": summary, "runs": runs}  # fmt: skip
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 1 if any(r["errors"] for rs in runs.values() for rows in rs for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
