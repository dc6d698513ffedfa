"""Load test of `mlx-spec serve` against `mlx_lm.server`: N concurrent streaming clients.

Both servers run as subprocesses on loopback ports, the same model in float32 and the same
BLAS for both (`LD_PRELOAD` for mlx_lm.server, which would otherwise use MLX's reference BLAS on
Linux); the clients (`httpx` async streams of `POST /v1/completions` with
`stream_options.include_usage`) run in this process, so the measurement covers HTTP, SSE, the
engine's scheduling and the model. For every speculation mode (the request's `speculative`
field; `none` is plain decoding) and every N, N clients each send `--requests` requests back
to back (different prompts, greedy, up to `--max-tokens` tokens each; with `--vary-tokens LO HI`
each request's own budget, drawn from LO..HI, the same draws for every mode and the peer), and
the script reports:

- throughput: completion tokens of all requests / wall time of the whole run;
- per-request latency (request sent -> last event) p50 / p95;
- time to first token (request sent -> first text event) p50 / p95;
- errors (any non-200 answer, error event or connection the server dropped; there should be
  none);
- tail: the share of the run after the first client was done (fewer than N streams ran:
  clients whose requests finished sooner wait for the others);
- steady throughput: the completion tokens streamed while all N clients ran (before the first
  was done; a request's tokens spread evenly over its text events) over that time. With
  requests of equal length plain decoding keeps its rows in step, so its run has no tail;
  speculation's rows finish apart, and its run ends with fewer than N streams;
- per request against plain decoding (every mode but `none`, where `none` runs too): each
  request's latency over the same request's (the same client and place in its sequence, so
  the same prompt and budget) in the same repeat with speculation off, pooled over the
  repeats: the share of requests more than 5% slower (`slower_than_plain`) and the ratio's
  p50 / p95 (`plain_ratio_p50`, `plain_ratio_p95`). Throughput and the latency percentiles
  pool the users; this says whether speculation made some of them slower. Two runs of the
  same requests differ without any speculation too (a shared machine's speed drifts from one
  run to the next, and a request's latency with it), so plain decoding runs twice in every
  repeat (`none` and `none-again`, in the rotation like any mode; `--no-plain-again` skips
  the second) and `none-again`'s row holds the same comparison between them: the noise the
  others' are read against.

After the load rows come conversations (`--turns`, default 4; `--conversation-only` for them
alone): each turn's prompt is the previous prompt + its reply + `--turn-tokens` new tokens of
held-out text, and its time to first token is reported with the prompt tokens the server took
from its prompt cache (each conversation opens with its own line, so none reuses another's);
every mode and the peer hold one conversation per repeat, in a rotated order, and each turn's
time to first token is the median over the repeats. The
same rows and conversation are measured on `mlx_lm.server` (skip with `--no-peer`), on a
float32 copy of the model. Both servers run at once, and every repeat
(`--repeats`, default 3) runs each N for every mode and the peer back to back, in an order
rotated per repeat, so a change in the machine's load falls on all of them alike; the rows
are the medians over the repeats, and each mode's throughput is printed over the peer's at
every N.

By default it serves the embedded demo pair (its target and draft model; prompts are the
openings of the held-out standard-library files). `--random` builds two random llama
checkpoints with the test suite's helpers instead (tests/tinymodels.py; character tokenizer,
hidden 256, 4 layers, a draft model that is a perturbed copy of the target);
`--model`/`--draft-model` take any others.

Examples:
    python benchmarks/server_load.py                       # N = 1, 4, 8; each mode; the peer
    python benchmarks/server_load.py --quick
    python benchmarks/server_load.py --vary-tokens 16 112 --requests 4 --turns 0
    python benchmarks/server_load.py --model ./target --draft-model ./draft --json load.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx_spec  # noqa: F401  (first: loads the optimized BLAS before anything imports mlx)
from mlx_spec.bench.harness import machine_info
from mlx_spec.platform import blas as _blas

import httpx
import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import load as load_tokenizer

_TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
PROMPTS = ["abcab cab", "mad pop", "a nice deal", "look back", "fog on a hill", "imp"]
SHAPE = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 768,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
}


def build_models(root: Path) -> tuple[Path, Path]:
    """A random llama target and a perturbed copy as its draft model (tests' helpers)."""
    sys.path.insert(0, str(_TESTS_DIR))
    import tinymodels as tm

    config = tm.llama_config(tm.tokenizer_size(), **SHAPE)
    weights = tm.random_weights(config, seed=1)
    target = tm.write_checkpoint(root / "target", config, weights)
    draft = tm.write_checkpoint(root / "draft", config, tm.perturb(weights, 0.2, seed=2))
    return target, draft


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    """Send one streaming completion; returns its timings, token count and error (if any: a
    connection the server dropped or reset counts as the request's error, not the run's)."""
    try:
        return await _one_request(client, body)
    except httpx.TransportError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


async def _one_request(client: httpx.AsyncClient, body: dict) -> dict:
    tic = time.perf_counter()
    first, tokens, error, acceptance = None, 0, None, 0.0
    pieces, prompt_tokens, cached, stamps = [], 0, 0, []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"error": f"{response.status_code}: {response.text[:200]}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = str(event["error"])
                continue
            if event.get("usage"):
                usage = event["usage"]
                tokens = usage["completion_tokens"]
                prompt_tokens = usage.get("prompt_tokens", 0)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                acceptance = (usage.get("speculative") or {}).get("acceptance_rate", 0.0)
            if event.get("choices") and event["choices"][0].get("text"):
                pieces.append(event["choices"][0]["text"])
                stamps.append(time.perf_counter())
                if first is None:
                    first = stamps[-1] - tic
    latency = time.perf_counter() - tic
    return {
        "latency": latency, "ttft": first, "tokens": tokens or len(stamps), "error": error,
        "acceptance": acceptance, "text": "".join(pieces), "prompt_tokens": prompt_tokens,
        "cached_tokens": cached, "stamps": stamps,
    }  # fmt: skip


def token_budgets(concurrency: int, requests: int, vary: list[int] | None) -> list | None:
    """Per client, each request's `max_tokens` drawn uniformly from `vary` = [LO, HI] (seeded by
    N: every mode and the peer get the same ones); None: the body's own for every request."""
    if not vary:
        return None
    rng = np.random.default_rng(concurrency)
    return rng.integers(vary[0], vary[1] + 1, size=(concurrency, requests)).tolist()


async def run_load(
    url: str, concurrency: int, requests: int, body: dict, budgets: list[list[int]] | None = None
) -> dict:
    """`concurrency` clients, each sending `requests` requests back to back (`budgets`: client
    i's request r asks for `budgets[i][r]` tokens)."""

    finished: list[float] = []  # when each client's last request ended

    async def client_loop(index: int) -> list[dict]:
        out = []
        for r in range(requests):
            prompt = PROMPTS[(index * requests + r) % len(PROMPTS)]
            own = {} if budgets is None else {"max_tokens": budgets[index][r]}
            out.append(await one_request(client, {**body, "prompt": prompt, **own}))
        finished.append(time.perf_counter())
        return out

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        tic = time.perf_counter()
        results = await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
        wall = time.perf_counter() - tic
    done = [r for rs in results for r in rs if not r.get("error")]
    errors = sum(1 for rs in results for r in rs if r.get("error"))

    def per_request(key: str) -> list[list]:
        """Per client, each request's `key` in order (None: it failed; `versus_plain`)."""
        return [[None if r.get("error") else r[key] for r in rs] for rs in results]

    latencies = [r["latency"] for r in done]
    ttfts = [r["ttft"] for r in done if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in done)
    steady = min(finished) - tic  # every client had a request in flight until then
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {
        "concurrency": concurrency,
        "requests": concurrency * requests,
        "errors": errors,
        "completion_tokens": tokens,
        "wall_seconds": wall,
        # The share of the run after the first client was done: fewer streams than N ran.
        "tail_share": (tic + wall - min(finished)) / wall if wall else 0.0,
        "throughput_tokens_per_sec": tokens / wall if wall else 0.0,
        "steady_tokens_per_sec": _tokens_before(done, tic + steady) / steady if steady else 0.0,
        "latency_p50_s": pct(latencies, 50),
        "latency_p95_s": pct(latencies, 95),
        "ttft_p50_ms": pct(ttfts, 50) * 1e3,
        "ttft_p95_ms": pct(ttfts, 95) * 1e3,
        "acceptance_rate": statistics.mean(r["acceptance"] for r in done) if done else 0.0,
        "per_stream_tokens_per_sec": statistics.median(
            r["tokens"] / r["latency"] for r in done
        ) if done else 0.0,
        "request_latencies": per_request("latency"),
        "request_acceptance": per_request("acceptance"),
    }  # fmt: skip


SLOWER = 1.05  # a request this much slower than with speculation off counts as slower


def versus_plain(runs: list[dict], plain: list[dict]) -> dict:
    """Each request's latency in `runs` (one load row per repeat) over the same request's in
    `plain`'s row of the same repeat, pooled over the repeats: the share more than `SLOWER`
    times slower and the ratio's p50 and p95 (requests that failed on either side left out)."""
    ratios = []
    for run, base in zip(runs, plain, strict=False):
        for mine, theirs in zip(run["request_latencies"], base["request_latencies"], strict=True):
            for a, b in zip(mine, theirs, strict=True):
                if a is not None and b:
                    ratios.append(a / b)
    if not ratios:
        return {}
    return {
        "slower_than_plain": sum(r > SLOWER for r in ratios) / len(ratios),
        "plain_ratio_p50": float(np.percentile(ratios, 50)),
        "plain_ratio_p95": float(np.percentile(ratios, 95)),
    }


def paired_throughput(runs: list[dict], plains: list[list[dict]]) -> dict:
    """Each repeat's throughput over the same repeat's plain decoding (the mean of its runs
    in `plains`: `none`, and `none-again` where it ran), averaged over the repeats with its
    standard error: a machine's spells move both sides of a repeat alike, so the pairs'
    spread is the comparison's noise, not the spells'."""
    ratios = []
    for i, run in enumerate(runs):
        base = [p[i]["throughput_tokens_per_sec"] for p in plains if i < len(p)]
        if base and all(base):
            ratios.append(run["throughput_tokens_per_sec"] / statistics.mean(base))
    if not ratios:
        return {}
    spread = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
    return {"throughput_vs_plain_paired": statistics.mean(ratios), "paired_se": spread}


def _tokens_before(done: list[dict], until: float) -> float:
    """Completion tokens the requests had streamed by `until` (a request's tokens spread evenly
    over its text events: an event may carry several tokens under speculation)."""
    total = 0.0
    for r in done:
        stamps = r["stamps"]
        if stamps:
            total += r["tokens"] * sum(1 for t in stamps if t <= until) / len(stamps)
    return total


class ServerProcess:
    """A server in a subprocess on a free loopback port, with the optimized BLAS preloaded
    (mlx_lm.server would otherwise use MLX's reference BLAS on Linux, ~90x slower; mlx-spec
    loads it itself). Both servers run the same way, apart from the benchmark's clients."""

    def __init__(self, name: str, command: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.env = dict(os.environ, HF_HUB_OFFLINE="1")
        blas = _blas.preload()
        if blas:
            self.env["LD_PRELOAD"] = blas
        Path.home().joinpath(".cache", "huggingface", "hub").mkdir(parents=True, exist_ok=True)
        self.name = name
        self.command = command + ["--host", "127.0.0.1", "--port", str(self.port)]
        self.process = None

    def __enter__(self) -> str:
        # The log goes to a file: a pipe nobody reads would fill and block the server.
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=subprocess.DEVNULL, stderr=self.log
        )
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} exited: {self.log.read()[-2000:]!r}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start within 300 s")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def spec_server(args, slots: int) -> ServerProcess:
    """`mlx-spec serve` with every drafter the benchmark measures."""
    command = [
        sys.executable, "-m", "mlx_spec.cli", "serve", "--model", args.model,
        "--model-id", "bench", "--max-concurrent", str(slots), "--num-draft", str(args.num_draft),
        "--max-tokens-limit", str(max(args.max_tokens, 16)),
    ]  # fmt: skip
    if args.draft_model:
        command += ["--draft-model", args.draft_model]
    if args.pace_slack is not None:
        command += ["--pace-slack", args.pace_slack]
    if args.trace_steps:
        command += ["--trace-steps", str(Path(args.trace_steps).resolve())]
    mtp = args.mtp or (args.model if (Path(args.model) / "mtp").is_dir() else None)
    if mtp:
        command += ["--mtp", mtp]
    # EAGLE-3 and DFlash join the server (and its "all" group) when a mode asks for them.
    for mode, flag in (("eagle3", "--eagle"), ("dflash", "--dflash")):
        if mode in args.modes:
            command += [flag, getattr(args, mode) or args.model]
    return ServerProcess("mlx-spec serve", command)


# mlx_lm.server started with mlx-spec's CPU fast paths: `import mlx_spec` installs the
# vectorized exp and the fused RoPE / RMSNorm; mlx-lm's loader is wrapped so that the model's
# linear weights get the layout `mlx_spec.load` gives them (timed on this machine).
_PEER_FAST = """
import runpy
import mlx_spec
import mlx.core as mx
import mlx_lm.utils
from mlx_spec.platform import weight_layout
_load_model = mlx_lm.utils.load_model
def load_model(*args, **kwargs):
    model, config = _load_model(*args, **kwargs)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    weight_layout.decide(model)
    weight_layout.column_major(model)
    return model, config
mlx_lm.utils.load_model = load_model
runpy.run_module("mlx_lm.server", run_name="__main__")
"""


def peer_server(model_dir: Path, fast_math: bool = False) -> ServerProcess:
    """mlx_lm.server; with `fast_math`, with mlx-spec's CPU fast paths too (the vectorized exp,
    the fused RoPE / RMSNorm, the linear weights' layout: `_PEER_FAST`)."""
    if fast_math:
        command = [sys.executable, "-c", _PEER_FAST]
    else:
        command = [sys.executable, "-m", "mlx_lm.server"]
    return ServerProcess("mlx_lm.server", command + ["--model", str(model_dir)])


def float32_copy(source: Path, dest: Path) -> Path:
    """The model directory with float32 weights: the dtype mlx-spec computes in on CPU, so the
    peer does the same arithmetic. On a GPU mlx-spec keeps the checkpoint's dtype, and so does
    the peer: the directory is returned as it is."""
    if mx.default_device() != mx.cpu:
        return source
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix == ".safetensors":
            weights = mx.load(str(f))
            weights = {
                k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
                for k, v in weights.items()
            }
            mx.save_safetensors(str(dest / f.name), weights, metadata={"format": "mlx"})
        elif f.is_file():
            shutil.copy(f, dest / f.name)
    return dest


def conversation_turns(tokenizer, texts: list[str], turns: int, new_tokens: int) -> list[str]:
    """The new text of each turn: `new_tokens` tokens of the held-out files each."""
    ids = [t for text in texts for t in tokenizer.encode(text)]
    return [tokenizer.decode(ids[i * new_tokens : (i + 1) * new_tokens]) for i in range(turns)]


async def run_conversation(url: str, body: dict, turns: list[str]) -> list[dict]:
    """One conversation: each turn's prompt is the previous prompt + its reply + new text, so
    a server with a prompt cache prefills only the reply and the new text."""
    rows, prompt = [], ""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for i, new in enumerate(turns):
            prompt += new
            result = await one_request(client, {**body, "prompt": prompt})
            if result.get("error"):
                raise RuntimeError(f"turn {i + 1}: {result['error']}")
            rows.append({
                "turn": i + 1, "prompt_chars": len(prompt), "ttft_ms": result["ttft"] * 1e3,
                "prompt_tokens": result["prompt_tokens"], "cached_tokens": result["cached_tokens"],
            })  # fmt: skip
            prompt += result["text"]
    return rows


def warm_up(url: str, body: dict, concurrency: list[int]) -> None:
    """A short request per client at every N the run measures, unmeasured: the first batch of
    each size meets costs paid once per process (on MLX's CUDA backend, kernels built for new
    shapes: 8-16 s on a fresh machine, falling otherwise on whichever mode ran first)."""
    for n in concurrency:
        asyncio.run(run_load(url, n, 1, {**body, "max_tokens": 8}))


def mode_configs(modes: list[str], url: str, body: dict, plain_again: bool = True) -> list:
    """(label, url, request body) of each mode, and with `plain_again`, where a speculative
    mode runs beside `none`, plain decoding a second time as `none-again` (the noise floor
    of the per-request comparison; see the module's text)."""
    configs = []
    for mode in modes:
        speculative = {"enabled": False} if mode == "none" else {"drafter": mode, "enabled": True}
        configs.append((mode, url, {**body, "speculative": speculative}))
    if plain_again and "none" in modes and len(set(modes)) > 1:
        configs.append(("none-again", url, configs[modes.index("none")][2]))
    return configs


def marks_file(trace: str) -> str:
    """Where the runs' times go beside a step trace (`--trace-steps`): TRACE.marks.jsonl."""
    return f"{trace}.marks.jsonl"


def uncollected(run):
    """`asyncio.run(run)` with the garbage collector off (a collection first): the clients
    share the machine with the server, and a full collection of this process (its results
    so far, the tokenizer: 50-100 ms on a 2-core x86) in the middle of one run would slow
    that run's server alone."""
    gc.collect()
    gc.disable()
    try:
        return asyncio.run(run)
    finally:
        gc.enable()


def measure_loads(configs: list[tuple[str, str, dict]], args) -> list[dict]:
    """The load rows of every (label, url, body) at every N: each repeat runs them all back to
    back in a rotated order; the medians over the repeats, each field on its own."""
    for _, url, body in configs:
        warm_up(url, body, args.concurrency)
    runs: dict[tuple[str, int], list[dict]] = {}
    for repeat in range(args.repeats):
        for n in args.concurrency:
            shift = repeat % len(configs)
            for label, url, body in configs[shift:] + configs[:shift]:
                budgets = token_budgets(n, args.requests, args.vary_tokens)
                start = time.time()
                load = run_load(url, n, args.requests, body, budgets)
                row = {"mode": label, **uncollected(load)}
                if args.trace_steps:  # when each run was, for `mlx-spec steps`
                    mark = {"mode": label, "n": n, "repeat": repeat + 1, "start": start}
                    with open(marks_file(args.trace_steps), "a") as marks:
                        marks.write(json.dumps({**mark, "end": time.time()}) + "\n")
                runs.setdefault((label, n), []).append(row)
                print(f"[{repeat + 1}/{args.repeats}] " + _format(row), flush=True)
    rows = []
    for (label, n), group in runs.items():
        row = {"mode": label, "concurrency": n, "repeats": len(group)}
        for key, value in group[0].items():
            if key in ("requests", "completion_tokens"):
                row[key] = value
            elif key == "errors":
                row[key] = sum(r[key] for r in group)
            elif isinstance(value, (int, float)) and key not in row:
                row[key] = statistics.median(r[key] for r in group)
        for key in ("request_latencies", "request_acceptance"):  # per repeat, client, request
            row[key] = [r[key] for r in group]
        row["throughput_per_repeat"] = [r["throughput_tokens_per_sec"] for r in group]
        if label != "none" and ("none", n) in runs:
            row.update(versus_plain(group, runs["none", n]))
            plains = [runs[m, n] for m in ("none", "none-again") if (m, n) in runs]
            row.update(paired_throughput(group, plains))
        rows.append(row)
    return sorted(rows, key=lambda r: ([c[0] for c in configs].index(r["mode"]), r["concurrency"]))


def measure_conversations(configs: list[tuple[str, str, dict]], turns: list[str], repeats: int):
    """`repeats` conversations per (label, url, body), each opening with its own line (no
    entry of another helps), in a rotated order; per turn the median time to first token."""
    runs: dict[str, list[list[dict]]] = {label: [] for label, _, _ in configs}
    for repeat in range(repeats):
        shift = repeat % len(configs)
        for label, url, body in configs[shift:] + configs[:shift]:
            own = [f"Conversation {repeat + 1} with {label}.\n" + turns[0], *turns[1:]]
            runs[label].append(uncollected(run_conversation(url, body, own)))
            _print_conversation(f"[{repeat + 1}/{repeats}] {label}", runs[label][-1])
    rows = []
    for label, talks in runs.items():
        median = [
            {**talks[0][i], "ttft_ms": statistics.median(t[i]["ttft_ms"] for t in talks)}
            for i in range(len(talks[0]))
        ]
        runs_ms = [[round(t[i]["ttft_ms"], 1) for t in talks] for i in range(len(talks[0]))]
        _print_conversation(f"median {label}", median)
        rows.append({"mode": label, "conversation": median, "ttft_ms_runs": runs_ms})
    return rows


def _print_conversation(label: str, conversation: list[dict]) -> None:
    print(
        f"{label:>13} conversation: TTFT by turn "
        + " -> ".join(f"{t['ttft_ms']:.0f}" for t in conversation)
        + " ms; prompt tokens "
        + " -> ".join(str(t["prompt_tokens"]) for t in conversation)
        + "; cached "
        + " -> ".join(str(t["cached_tokens"]) for t in conversation),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        help="target MLX directory or a known model's short name, e.g. smollm2 (its drafters "
        "beside it: MODEL/draft, MODEL/mtp, MODEL/eagle3; default: the embedded demo pair)",
    )
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help='chat prompts (JSON lines with "prompt", e.g. benchmarks/prompts/chat.jsonl), sent '
        "through the model's chat template (default: openings of held-out code)",
    )
    p.add_argument("--random", action="store_true", help="a random llama pair built here instead")
    p.add_argument("--draft-model", help="draft model for the 'draft-model' mode")
    p.add_argument("--mtp", help="MTP drafter directory (default: MODEL/mtp when it exists)")
    p.add_argument("--eagle3", help="EAGLE-3 head for the 'eagle3' mode (default: MODEL/eagle3)")
    p.add_argument("--dflash", help="DFlash drafter for the 'dflash' mode (default: MODEL/dflash)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests", type=int, default=3, help="requests per client (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    p.add_argument(
        "--vary-tokens",
        nargs=2,
        type=int,
        metavar=("LO", "HI"),
        help="each request asks for a max_tokens drawn from LO..HI (the same draws for every "
        "mode and the peer) instead of --max-tokens: requests of different lengths, as real "
        "traffic; with equal lengths, plain decoding keeps its rows in step, speculation not",
    )
    p.add_argument("--num-draft", default="auto", help="k or auto (default auto)")
    p.add_argument(
        "--modes",
        nargs="+",
        default=["none", "ngram", "draft-model", "mtp", "all"],
        help="speculation modes: none, ngram, draft-model, mtp, eagle3, dflash, all (default: "
        "none ngram draft-model mtp all; naming eagle3 or dflash loads them, and 'all' then "
        "holds them too)",
    )
    p.add_argument("--max-concurrent", type=int, help="engine slots (default: the largest N)")
    p.add_argument("--turns", type=int, default=4, help="conversation turns (0: none)")
    p.add_argument("--turn-tokens", type=int, default=180, help="new tokens per turn")
    p.add_argument(
        "--conversation-only", action="store_true", help="only the conversations (no load rows)"
    )
    p.add_argument("--no-peer", action="store_true", help="skip mlx_lm.server")
    p.add_argument(
        "--no-plain-again",
        action="store_true",
        help="run plain decoding once per repeat (by default twice where a speculative mode "
        "runs too: 'none-again', whose comparison with 'none' request by request is the "
        "noise the speculative modes' comparisons are read against)",
    )
    p.add_argument(
        "--peer-fast-math",
        action="store_true",
        help="give mlx_lm.server mlx-spec's CPU fast paths too (vectorized exp, fused RoPE and "
        "RMSNorm, the weights' layout mlx-spec picks; by default it runs MLX's own)",
    )
    p.add_argument(
        "--pace-slack",
        metavar="SHARE",
        help="start mlx-spec serve with --pace-slack SHARE (each request's pace against plain "
        "decoding; by default the server's own default, off)",
    )
    p.add_argument(
        "--trace-steps",
        metavar="FILE",
        help="mlx-spec serve appends each of its engine's steps to FILE (`serve --trace-steps`), "
        "and each load run's mode, N and times go to FILE.marks.jsonl; `mlx-spec steps "
        "FILE` summarises them, per run",
    )
    p.add_argument("--quick", action="store_true", help="N = 1 and 4, 1 request, 32 tokens")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--summary", metavar="JSON", help="print a results file as markdown tables")
    args = p.parse_args(argv)
    if args.summary:
        print(summary(json.loads(Path(args.summary).read_text())))
        return 0
    if args.quick:
        args.concurrency, args.requests, args.max_tokens, args.repeats = [1, 4], 1, 32, 1
    if args.vary_tokens:
        lo, hi = args.vary_tokens
        if not 1 <= lo <= hi:
            p.error("--vary-tokens needs 1 <= LO <= HI")
        args.max_tokens = max(args.max_tokens, hi)  # the servers' limit
    num_draft = args.num_draft if args.num_draft == "auto" else int(args.num_draft)

    built = args.model is None and args.random
    texts = PROMPTS
    if args.model is not None:
        args.model = _known_model(args.model)
        draft = Path(args.model) / "draft"
        if args.draft_model is None and (draft / "config.json").is_file():
            args.draft_model = str(draft)
    if args.model is None and not built:
        from mlx_spec.embedded import converted_pair, stdlib_files

        target_dir, draft_dir = converted_pair()
        args.model, args.draft_model = str(target_dir), args.draft_model or str(draft_dir)
        texts = [p.read_text(errors="replace") for p in stdlib_files()[1]]
        PROMPTS[:] = [text[:200] for text in texts]
    load_before = os.getloadavg()[0]
    slots = args.max_concurrent or max(args.concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        if built:
            target_dir, draft_dir = build_models(Path(tmp))
            args.model, args.draft_model = str(target_dir), args.draft_model or str(draft_dir)
        tokenizer = load_tokenizer(Path(args.model))
        if args.prompts:
            PROMPTS[:] = chat_prompts(tokenizer, Path(args.prompts))
            texts = PROMPTS
        turns = conversation_turns(tokenizer, texts, args.turns, args.turn_tokens)
        body = {
            "model": "bench", "max_tokens": args.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(spec_server(args, slots))
            configs = mode_configs(args.modes, url, body, not args.no_plain_again)
            if not args.no_peer:
                peer_dir = float32_copy(Path(args.model), Path(tmp) / "peer")
                peer_url = stack.enter_context(peer_server(peer_dir, args.peer_fast_math))
                configs.append(("mlx_lm.server", peer_url, {**body, "model": "default_model"}))
            rows = [] if args.conversation_only else measure_loads(configs, args)
            print("medians over the repeats:", flush=True)
            for row in rows:
                print(_format(row), flush=True)
            if turns:  # (one conversation of plain decoding is enough)
                talks = [c for c in configs if c[0] != "none-again"]
                rows += measure_conversations(talks, turns, args.repeats)
    if not args.no_peer:
        print(_versus(rows), flush=True)

    record = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        **machine_info(),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "model": f"random llama {json.dumps(SHAPE)}" if built else Path(args.model).name,
        "max_tokens": args.max_tokens,
        "vary_tokens": args.vary_tokens,
        "requests_per_client": args.requests,
        "repeats": args.repeats,
        "max_concurrent": slots,
        "num_draft": num_draft,
        "peer_fast_math": args.peer_fast_math,
        "pace_slack": args.pace_slack,
        "results": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 1 if any(r.get("errors") for r in rows) else 0


def _known_model(name: str) -> str:
    """A short name of a known model (smollm2): its converted folder; anything else as is."""
    from mlx_spec import catalog

    known = catalog.known(name)
    return name if known is None else str(catalog.model_dir(known))


def chat_prompts(tokenizer, path: Path) -> list[str]:
    """Chat prompts (JSON lines with "prompt") as the text of a one-turn conversation through
    the model's chat template: both servers get the same text on /v1/completions."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        for row in rows
    ]


def _versus(rows: list[dict]) -> str:
    """Each mode's throughput over mlx_lm.server's at every N."""
    peer = {
        r["concurrency"]: r for r in rows if r["mode"] == "mlx_lm.server" and "concurrency" in r
    }
    lines = ["throughput over mlx_lm.server's:"]
    for r in rows:
        if r["mode"] != "mlx_lm.server" and r.get("concurrency") in peer:
            base = peer[r["concurrency"]]["throughput_tokens_per_sec"]
            ratio = r["throughput_tokens_per_sec"] / base if base else float("nan")
            lines.append(f"  {r['mode']:>12} N={r['concurrency']}: {ratio:.2f}x")
    return "\n".join(lines)


def summary(record: dict) -> str:
    """Markdown tables of a results file: the load rows against the peer, the conversations."""
    rows = record["results"]
    peer = {
        r["concurrency"]: r["throughput_tokens_per_sec"]
        for r in rows
        if r["mode"] == "mlx_lm.server" and "concurrency" in r
    }
    lines = [
        "| mode | N | throughput (tokens/s) | over mlx_lm.server | while all N ran (tokens/s) "
        "| per stream (tokens/s) | latency p50 / p95 (s) | time to first token p50 / p95 (ms) "
        "| acceptance | requests slower than plain (latency ratio p95) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "concurrency" not in r:
            continue
        base = peer.get(r["concurrency"])
        versus = f"{r['throughput_tokens_per_sec'] / base:.2f}x" if base else "-"
        steady = f"{r['steady_tokens_per_sec']:.1f}" if "steady_tokens_per_sec" in r else "-"
        plain = r["mode"] in ("none", "none-again", "mlx_lm.server")
        accept = "-" if plain else f"{r['acceptance_rate']:.2f}"
        slower = "-"
        if "slower_than_plain" in r:
            slower = f"{r['slower_than_plain']:.0%} ({r['plain_ratio_p95']:.2f})"
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['throughput_tokens_per_sec']:.1f} | {versus} "
            f"| {steady} "
            f"| {r['per_stream_tokens_per_sec']:.1f} | {r['latency_p50_s']:.2f} / "
            f"{r['latency_p95_s']:.2f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f} "
            f"| {accept} | {slower} |"
        )
    talks = [r for r in rows if "conversation" in r]
    if talks:
        turns = talks[0]["conversation"]
        lines += [
            "",
            "| server, mode | " + " | ".join(f"turn {t['turn']}" for t in turns) + " |",
            "| --- |" + " ---: |" * len(turns),
            "| prompt tokens (cached) | "
            + " | ".join(f"{t['prompt_tokens']} ({t['cached_tokens']})" for t in turns)
            + " |",
        ]
        for r in talks:
            lines.append(
                f"| {r['mode']}: time to first token (ms) | "
                + " | ".join(f"{t['ttft_ms']:.0f}" for t in r["conversation"])
                + " |"
            )
    return "\n".join(lines)


def _format(row: dict) -> str:
    return (
        f"{row['mode']:>13} N={row['concurrency']:<2} {row['requests']:>3} requests "
        f"{row['completion_tokens']:>5} tokens  throughput {row['throughput_tokens_per_sec']:7.1f}"
        f" tok/s  per stream {row['per_stream_tokens_per_sec']:6.1f} tok/s  latency p50 "
        f"{row['latency_p50_s']:.2f}s p95 {row['latency_p95_s']:.2f}s  TTFT p50 "
        f"{row['ttft_p50_ms']:.0f}ms p95 {row['ttft_p95_ms']:.0f}ms  acceptance "
        f"{row['acceptance_rate']:.2f}  tail {row.get('tail_share', 0.0):.0%}  steady "
        f"{row.get('steady_tokens_per_sec', 0.0):.1f} tok/s  "
        f"errors {row['errors']}" + _versus_plain_text(row)
    )


def _versus_plain_text(row: dict) -> str:
    if "slower_than_plain" not in row:
        return ""
    paired = ""
    if "throughput_vs_plain_paired" in row:
        paired = (
            f"  throughput over the same repeat's plain: {row['throughput_vs_plain_paired']:.3f}"
            f" +- {row['paired_se']:.3f}"
        )
    return (
        f"  per request vs plain: {row['slower_than_plain']:.0%} slower, latency ratio p50 "
        f"{row['plain_ratio_p50']:.2f} p95 {row['plain_ratio_p95']:.2f}" + paired
    )


if __name__ == "__main__":
    sys.exit(main())
