"""One rank of a distributed test run (started by tests/test_distributed.py with MLX_RANK and
MLX_HOSTFILE set, or alone as the single-process reference).

Usage: python distributed_worker.py JOB.json
JOB: {"model", "shard", "drafter" ("none", "ngram", "mtp", "eagle3:DIR" or a draft model
directory; a list: one after the other, run by run), "num_draft" (a list: the same way),
"prompt", "max_tokens",
"temperature", "top_k", "runs", "seed", "negative_control" (a broken verifier of
helpers.NEGATIVE_CONTROLS, installed on every rank)}.
Prints one JSON line: {"rank", "world_size", "tokens": [...per run], "accepted": drafts
accepted over all runs, "stats": the last run's, "run_stats": [...per run]}.
"""

from __future__ import annotations

import json
import sys

import mlx_spec
from mlx_spec.decoding import distributed


def drafter_for(spec: str, model):
    if spec == "none":
        return None
    if spec in ("ngram", "mtp"):
        return spec
    if spec.startswith("eagle3:"):
        return mlx_spec.load_eagle3_drafter(spec.split(":", 1)[1], model)
    return mlx_spec.load_drafter(spec)


def main() -> int:
    job = json.loads(open(sys.argv[1]).read())
    if job.get("negative_control"):
        from helpers import NEGATIVE_CONTROLS

        module, name, stand_in = NEGATIVE_CONTROLS[job["negative_control"]]
        setattr(module, name, stand_in)
    group = distributed.world()
    shard = job.get("shard") if group is not None else None
    model, tokenizer = mlx_spec.load(job["model"], shard=shard)
    tokenizer.eos_token_ids = set()  # generations of fixed length
    rank = group.rank() if group is not None else 0
    specs = job.get("drafter", "none")
    drafters = [drafter_for(spec, model) for spec in ([specs] if isinstance(specs, str) else specs)]
    lengths = job.get("num_draft", "auto")
    lengths = lengths if isinstance(lengths, list) else [lengths]
    outputs, accepted, stats, run_stats = [], 0, None, []
    for run in range(job.get("runs", 1)):
        stream = mlx_spec.stream_generate(
            model,
            tokenizer,
            job["prompt"],
            drafter=drafters[run % len(drafters)],  # a list: taken in turn, run by run
            num_draft=lengths[run % len(lengths)],
            max_tokens=job["max_tokens"],
            temperature=job.get("temperature", 0.0),
            top_k=job.get("top_k", 0),
            seed=job["seed"] + run if "seed" in job else None,
        )
        tokens = []
        for chunk in stream:
            if chunk.token is not None:
                tokens.append(chunk.token)
            stats = chunk.stats
        outputs.append(tokens)
        accepted += stats.accepted
        run_stats.append(stats.to_dict())
    record = {"rank": rank, "world_size": stats.world_size, "tokens": outputs}
    record["accepted"] = accepted  # drafts accepted over all runs
    record["stats"], record["run_stats"] = run_stats[-1], run_stats
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
