"""Speculative decoding over a target sharded on several ranks: measured on loopback, and the
cost model's prediction of the speedup as the network's latency grows.

The embedded demo pair's target is split over 2 ranks (tensor parallel, MLX's ring backend on
127.0.0.1), every rank started by this script as `mlx.launch` starts them. On the same prompts
(the first 128 tokens of held-out standard-library files, greedy, EOS off) it measures plain
decoding and each drafter (its draft model, n-gram lookup, its MTP head; k chosen every round):
decode tokens/s, speedup over plain on the same ranks, tokens per target pass E, the
collectives of a pass and their priced time (`SpecStats.comm_seconds_per_pass`). The same modes
run in one process first, for the single-machine numbers beside them. The peer on the same
footing: mlx-lm's own plain decoding (`mlx_lm.stream_generate`, its reported generation
tokens/s) over the very same shards, in the same processes, interleaved with the modes (mlx-lm
refuses a draft model in distributed mode, so plain decoding is the peer there is).

The cost model: with per-pass compute t1 (plain) and tk (a speculative round: drafting plus the
verify pass), each measured here with the loopback communication taken out, and a pass paying
C collectives of latency l each (C counted here),

    speedup(l) = E * (t1 + C*l) / (tk + C*l)

which tends to E as the network dominates: the more a pass waits on the network, the more it
pays to verify several tokens per pass. The curve is evaluated over per-collective latencies from
RDMA-class to TCP-over-Ethernet (assumed figures, see LINKS), with the measured loopback point.

Examples:
    python benchmarks/distributed.py                       # 4 prompts x 64 tokens, 2 repeats
    python benchmarks/distributed.py --quick
    python benchmarks/distributed.py --json benchmarks/results/distributed.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx_spec  # first: loads the optimized BLAS before mlx
from mlx_spec.bench.harness import builtin_prompts
from mlx_spec.core.stats import merge_stats
from mlx_spec.decoding import distributed
from mlx_spec.embedded import converted_pair

from mlx_lm import stream_generate

MODES = ("plain", "draft-model", "ngram", "mtp")
PEER = "mlx-lm plain"
# Per-collective latency of a small all-reduce between 2 machines, by link. These are assumed
# order-of-magnitude figures, not measured here: kernel TCP round trips on 10 GbE are tens of
# microseconds plus the ring's own software overhead; Thunderbolt 5 carries TCP/IP (the
# Thunderbolt Bridge) at similar latency and RDMA (JACCL, macOS 26.2+, Apple's TN3205 and the
# MLX distributed docs: "low latency communication with RDMA over thunderbolt") at a few
# microseconds.
LINKS = {
    "RDMA over Thunderbolt 5 (JACCL)": 10e-6,
    "TCP over Thunderbolt 5 (ring)": 100e-6,
    "TCP over 10 GbE (ring)": 200e-6,
    "TCP over 1 GbE / Wi-Fi (ring)": 1e-3,
}
CURVE = [0, 5e-6, 10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3]


def measure(model, tokenizer, draft_dir: str, prompts, max_tokens: int, repeats: int) -> dict:
    """Every mode on every prompt, interleaved, after one warm-up generation each."""
    drafters = {
        "plain": None,
        "draft-model": mlx_spec.load_drafter(draft_dir),
        "ngram": "ngram",
        "mtp": mlx_spec.load_mtp_drafter(str(model._mlx_spec_source), model),
    }
    runs: dict[str, list] = {mode: [] for mode in MODES}
    peer: list[tuple[int, float]] = []  # (tokens, seconds) of mlx-lm's generations

    def once(mode, ids):
        return mlx_spec.generate(
            model, tokenizer, ids, drafter=drafters[mode], max_tokens=max_tokens
        ).stats

    def peer_once(ids) -> tuple[int, float]:
        *_, last = stream_generate(model, tokenizer, ids, max_tokens=max_tokens)
        return last.generation_tokens, last.generation_tokens / last.generation_tps

    for mode in MODES:  # warm-up: compile, fill the drafters' and policies' memories
        once(mode, prompts[0].ids)
    peer_once(prompts[0].ids)
    for _ in range(repeats):
        for prompt in prompts:
            for mode in MODES:
                runs[mode].append(once(mode, prompt.ids))
            peer.append(peer_once(prompt.ids))
    out = {}
    for mode in MODES:
        s = merge_stats(runs[mode])
        out[mode] = {
            "tokens_per_sec": s.decode_tokens_per_sec,
            "generated": s.generated_tokens,
            "target_passes": s.target_passes,
            "tokens_per_pass": s.generated_tokens / s.target_passes,
            "seconds_per_pass": s.decode_seconds / s.target_passes,
            "acceptance": s.acceptance_rate,
            "collectives_per_pass": s.comm_collectives / s.target_passes,
            "comm_seconds_per_pass": s.comm_seconds_per_pass,
            "world_size": s.world_size,
        }
    tokens, seconds = (sum(x) for x in zip(*peer, strict=True))
    out[PEER] = {"tokens_per_sec": tokens / seconds, "generated": tokens}
    plain = out["plain"]["tokens_per_sec"]
    for mode in (*MODES, PEER):
        out[mode]["speedup"] = out[mode]["tokens_per_sec"] / plain
    return out


def job(args) -> dict:
    """This process's share: load (sharded when launched), measure, return rank 0's record."""
    target, draft = converted_pair()
    group = distributed.world()
    model, tokenizer = mlx_spec.load(str(target), shard="tensor" if group else None)
    tokenizer.eos_token_ids = set()
    prompts = builtin_prompts(tokenizer, 128)[: args.prompts]
    record = measure(model, tokenizer, str(draft), prompts, args.max_tokens, args.repeats)
    if group is not None:
        ledger = distributed.sync_for(model).ledger
        record["probe"] = {"latency": ledger.latency, "seconds_per_byte": ledger.seconds_per_byte}
    return record


def launch(args, ranks: int) -> dict:
    """This script once per rank on loopback; rank 0's record."""
    ports = []
    for _ in range(ranks):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
        out = Path(tmp) / "rank0.json"
        argv = [sys.executable, __file__, "--worker", str(out), *sys.argv[1:]]
        # The ranks share this machine's cores: each gets its part for BLAS threads (OpenBLAS
        # threads spin; more threads than cores make every pass wait on the scheduler).
        threads = os.environ.get("OPENBLAS_NUM_THREADS") or str(max(1, os.cpu_count() // ranks))
        env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "OPENBLAS_NUM_THREADS": threads}
        procs = [subprocess.Popen(argv, env={**env, "MLX_RANK": str(r)}) for r in range(ranks)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        return json.loads(out.read_text())


def predicted(mode: dict, plain: dict, latency: float) -> float:
    """speedup(l) = E * (t1 + C l) / (tk + C l), compute times with loopback comm taken out."""
    t1 = plain["seconds_per_pass"] - plain["comm_seconds_per_pass"]
    tk = mode["seconds_per_pass"] - mode["comm_seconds_per_pass"]
    c1, ck = plain["collectives_per_pass"], mode["collectives_per_pass"]
    return mode["tokens_per_pass"] * (t1 + c1 * latency) / (tk + ck * latency)


def report(single: dict, shared: dict, ranks: int) -> dict:
    plain = shared["plain"]
    probe = shared["probe"]["latency"]
    model = {}
    for mode in MODES[1:]:
        m = shared[mode]
        model[mode] = {
            "measured_point": {"latency": probe, "speedup": m["speedup"]},
            "predicted_at_measured_point": predicted(m, plain, probe),
            "curve": [(lat, predicted(m, plain, lat)) for lat in CURVE],
            "links": {name: predicted(m, plain, lat) for name, lat in LINKS.items()},
            "limit": m["tokens_per_pass"],
        }
    return {"single_process": single, f"{ranks}_ranks": shared, "cost_model": model}


def markdown(result: dict, ranks: int) -> str:
    single, shared = result["single_process"], result[f"{ranks}_ranks"]
    lines = [
        f"| mode | 1 process tok/s | speedup | {ranks} ranks tok/s | speedup | tokens/pass | "
        "collectives/pass | comm ms/pass |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in MODES:
        a, b = single[mode], shared[mode]
        lines.append(
            f"| {mode} | {a['tokens_per_sec']:.1f} | {a['speedup']:.2f}x | "
            f"{b['tokens_per_sec']:.1f} | {b['speedup']:.2f}x | {b['tokens_per_pass']:.2f} | "
            f"{b['collectives_per_pass']:.1f} | {b['comm_seconds_per_pass'] * 1e3:.2f} |"
        )
    a, b = single[PEER], shared[PEER]
    lines.append(
        f"| {PEER} (peer) | {a['tokens_per_sec']:.1f} | {a['speedup']:.2f}x | "
        f"{b['tokens_per_sec']:.1f} | {b['speedup']:.2f}x | 1.00 | - | - |"
    )
    lines += ["", "| mode | " + " | ".join(LINKS) + " | limit (E) |"]
    lines.append("| --- |" + " ---: |" * (len(LINKS) + 1))
    for mode, m in result["cost_model"].items():
        cells = " | ".join(f"{v:.2f}x" for v in m["links"].values())
        lines.append(f"| {mode} | {cells} | {m['limit']:.2f}x |")
    probe = shared["probe"]["latency"]
    lines.append(
        f"\nloopback probe: {probe * 1e6:.0f} us per collective; predicted speedup there: "
        + ", ".join(
            f"{mode} {m['predicted_at_measured_point']:.2f}x (measured "
            f"{m['measured_point']['speedup']:.2f}x)"
            for mode, m in result["cost_model"].items()
        )
    )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="processes on loopback (default 2)")
    p.add_argument("--prompts", type=int, default=4, help="prompts (default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per generation (64)")
    p.add_argument("--repeats", type=int, default=2, help="passes over the prompts (default 2)")
    p.add_argument("--quick", action="store_true", help="2 prompts x 32 tokens, 1 repeat")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.repeats = 2, 32, 1
    if args.worker:  # one rank
        record = job(args)
        if distributed.world().rank() == 0:
            Path(args.worker).write_text(json.dumps(record))
        return 0
    tic = time.perf_counter()
    print("measuring in one process...", file=sys.stderr, flush=True)
    single = job(args)
    print(f"measuring on {args.ranks} ranks...", file=sys.stderr, flush=True)
    shared = launch(args, args.ranks)
    result = report(single, shared, args.ranks)
    result["settings"] = {
        "ranks": args.ranks, "prompts": args.prompts, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "shard": "tensor", "backend": "ring (loopback)",
        "seconds": time.perf_counter() - tic, "links": LINKS,
        "blas_threads_per_rank": os.environ.get("OPENBLAS_NUM_THREADS")
        or max(1, os.cpu_count() // args.ranks),
    }  # fmt: skip
    print(markdown(result, args.ranks))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
