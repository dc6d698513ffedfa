"""Speculative decoding on a real chat model (SmolLM2-135M-Instruct), beside its peers.

Every engine runs the same chat prompts (`benchmarks/prompts/chat.jsonl`: editing given text,
questions, code, stories), rendered once with the model's chat template into the same token
ids, with EOS on and `--max-tokens` at most, greedy and at T = 0.7, each in a process of its
own (a worker), all in one run:

- mlx-spec: plain decoding and each drafter shipped for the model (n-gram lookup, draft
  model, EAGLE-3 head, MTP head) with the draft length chosen every round, and `auto` (all of
  them as a group, the default of `mlx-spec generate --model smollm2`);
- mlx-lm on the same float32 weights with OpenBLAS preloaded: plain decoding, and its
  speculative decoding with the same draft model;
- llama.cpp through `llama-cpp-python` on the same `.gguf` file (2 threads): plain decoding and
  its prompt-lookup drafter;
- llama.cpp's own server (`llama-server`) on the same file: plain decoding and its
  speculative set-ups (n-gram lookups, and the same draft model written as GGUF by llama.cpp's
  converter).

Speedups are each engine's over its own plain decoding on the same prompt (decode tokens/s:
the tokens after the first over the time after the first token; the median over repeats), and
greedy outputs are compared token for token with the engine's plain decoding. Repeats rotate
the engines so machine noise spreads over them alike.

    python benchmarks/real_model.py --json benchmarks/results/real_model.json \\
        --llama-python /path/to/venv/bin/python --llama-lib /path/to/llama.cpp/build/bin \\
        --llama-server /path/to/llama.cpp/build/bin/llama-server \\
        --draft-gguf /path/to/draft.gguf

The llama.cpp engines run only when their paths are given (they are benchmark-only: never
needed by mlx-spec or its tests).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = HERE / "prompts" / "chat.jsonl"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
MODES = ("plain", "ngram", "draft", "eagle3", "mtp", "auto")


# ------------------------------------------------------------------------------- workers


def _timed(stream, token_of) -> dict:
    """Read a token stream: the tokens and when the call was made, the first and the last
    token arrived."""
    start = time.perf_counter()
    tokens, first, last = [], None, start
    for item in stream:
        token = token_of(item)
        if token is None:
            continue
        now = time.perf_counter()
        first = now if first is None else first
        last = now
        tokens.append(token)
    return {"tokens": tokens, "start": start, "first": first or last, "last": last}


def _record(run: dict, **extra) -> dict:
    n = len(run["tokens"])
    decode = run["last"] - run["first"]
    return {
        "tokens": run["tokens"],
        "decode_tps": (n - 1) / decode if n > 1 and decode > 0 else None,
        "e2e_tps": n / (run["last"] - run["start"]) if n else None,
        "ttft_ms": (run["first"] - run["start"]) * 1e3,
        **extra,
    }


def worker_mlx_spec(job: dict) -> list[dict]:
    import mlx_spec
    from mlx_spec import catalog

    model, tokenizer = mlx_spec.load(job["model"])
    folder = catalog.model_dir(catalog.known(job["model"]))
    loaders = {
        "ngram": lambda: "ngram",
        "draft": lambda: mlx_spec.load_drafter(str(folder / "draft")),
        "eagle3": lambda: mlx_spec.load_eagle3_drafter(str(folder / "eagle3"), model),
        "mtp": lambda: mlx_spec.load_mtp_drafter(str(folder / "mtp"), model),
    }
    drafters = {}
    for name, make in loaders.items():
        if name == "ngram" or (folder / name / "config.json").is_file():
            drafters[name] = make()
    drafters["auto"] = list(drafters.values())
    out = []
    for temperature in job["temperatures"]:
        for p, prompt in enumerate(job["prompts"]):
            modes = [m for m in job["modes"] if m == "plain" or m in drafters]
            shift = p % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                stream = mlx_spec.stream_generate(
                    model, tokenizer, prompt["ids"], drafter=drafters.get(mode),
                    temperature=temperature, max_tokens=job["max_tokens"], seed=job["seed"] + p,
                )  # fmt: skip
                chunks = []
                run = _timed(stream, lambda c, seen=chunks: seen.append(c) or c.token)
                stats = chunks[-1].stats
                out.append(
                    _record(
                        run,
                        engine="mlx-spec",
                        mode=mode,
                        temperature=temperature,
                        prompt=prompt["id"],
                        acceptance_by_position=stats.acceptance_by_position,
                        drafted_per_position=stats.drafted_per_position,
                        mean_accepted_length=stats.mean_accepted_length,
                        k_histogram={str(k): n for k, n in stats.k_histogram.items()},
                        drafter_rounds=dict(stats.drafter_rounds),
                    )  # fmt: skip
                )
    return out


def worker_mlx_lm(job: dict) -> list[dict]:
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(job["model_dir"])
    draft = None
    if "spec" in job["modes"]:
        draft, _ = load(job["draft_dir"])
        draft.set_dtype(mx.float32)  # the weights mlx-spec runs on a CPU (shipped as float16)
    out = []
    for temperature in job["temperatures"]:
        for p, prompt in enumerate(job["prompts"]):
            modes = list(job["modes"])
            shift = p % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                mx.random.seed(job["seed"] + p)
                extra = (
                    {"draft_model": draft, "num_draft_tokens": job["k"]} if mode == "spec" else {}
                )
                stream = stream_generate(
                    model, tokenizer, prompt["ids"], max_tokens=job["max_tokens"],
                    sampler=make_sampler(temp=temperature), **extra,
                )  # fmt: skip
                flags = []

                def token(r, flags=flags):
                    if r.finish_reason is not None and r.token in tokenizer.eos_token_ids:
                        return None
                    flags.append(bool(getattr(r, "from_draft", False)))
                    return int(r.token)

                run = _timed(stream, token)
                out.append(
                    _record(
                        run,
                        engine="mlx-lm",
                        mode=mode,
                        temperature=temperature,
                        prompt=prompt["id"],
                        from_draft=sum(flags),
                    )  # fmt: skip
                )
    return out


def worker_llama_cpp(job: dict) -> list[dict]:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def make(mode):
        draft = None
        if mode.startswith("lookup"):
            draft = LlamaPromptLookupDecoding(num_pred_tokens=int(mode[len("lookup") :]))
        return Llama(
            model_path=job["gguf"], n_threads=2, n_ctx=4096, draft_model=draft, verbose=False
        )

    def tokens(llm, ids, temperature, most):
        eos = llm.token_eos()
        for n, token in enumerate(
            llm.generate(
                ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True
            )  # fmt: skip
        ):
            if token == eos:
                return
            yield int(token)
            if n + 1 >= most:
                return

    engines = {mode: make(mode) for mode in job["modes"]}
    out = []
    for temperature in job["temperatures"]:
        for p, prompt in enumerate(job["prompts"]):
            modes = list(job["modes"])
            shift = p % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                llm = engines[mode]
                llm.set_seed(job["seed"] + p)
                run = _timed(tokens(llm, prompt["ids"], temperature, job["max_tokens"]), int)
                out.append(
                    _record(
                        run,
                        engine="llama-cpp-python",
                        mode=mode,
                        temperature=temperature,
                        prompt=prompt["id"],
                    )  # fmt: skip
                )
    return out


def worker_llama_server(job: dict) -> list[dict]:
    import socket
    import urllib.request

    out = []
    for mode in job["modes"]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = [job["server"], "-m", job["gguf"], "--port", str(port), "-t", "2", "-tb", "2",
                "-c", "4096", "--no-webui", "-np", "1", *job["server_modes"][mode]]  # fmt: skip
        server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_health(f"http://127.0.0.1:{port}/health", server)
            for temperature in job["temperatures"]:
                for p, prompt in enumerate(job["prompts"]):
                    body = {
                        "prompt": prompt["ids"], "n_predict": job["max_tokens"],
                        "temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                        "repeat_penalty": 1.0, "seed": job["seed"] + p, "cache_prompt": False,
                        "stream": True, "return_tokens": True,
                    }  # fmt: skip
                    request = urllib.request.Request(
                        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                        {"Content-Type": "application/json"},
                    )  # fmt: skip
                    with urllib.request.urlopen(request, timeout=600) as response:
                        run = _timed(_sse_tokens(response), lambda t: t)
                    out.append(_record(run, engine="llama-server", mode=mode,
                                       temperature=temperature, prompt=prompt["id"]))  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=60)
    return out


def _wait_health(url: str, proc) -> None:
    import urllib.request

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError("llama-server did not start")


def _sse_tokens(response):
    """Token ids from llama-server's streamed completion events, one id at a time."""
    for line in response:
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: ") :])
        yield from event.get("tokens", [])
        if event.get("stop"):
            return


WORKERS = {
    "mlx-spec": worker_mlx_spec,
    "mlx-lm": worker_mlx_lm,
    "llama-cpp-python": worker_llama_cpp,
    "llama-server": worker_llama_server,
}


# ------------------------------------------------------------------------------ the run


def chat_prompts(path: Path, model: str, limit: int | None) -> list[dict]:
    """The prompts with their token ids through the model's chat template."""
    import mlx_spec
    from mlx_spec.serving.chat import chat_prompt

    _, tokenizer = mlx_spec.load(model)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if limit:
        by_kind: dict[str, list] = {}
        for row in rows:
            by_kind.setdefault(row["kind"], []).append(row)
        rows = [r for kind in by_kind.values() for r in kind[:limit]]
    for row in rows:
        text = chat_prompt(tokenizer, [{"role": "user", "content": row["prompt"]}])
        row["ids"] = list(tokenizer.encode(text, add_special_tokens=False))
    return rows


def run_worker(engine: str, job: dict, python: str, env: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(job))
        cmd = [
            python,
            str(Path(__file__).resolve()),
            "worker",
            engine,
            str(job_file),
            str(out_file),
        ]
        subprocess.run(cmd, check=True, env={**os.environ, **env})
        return json.loads(out_file.read_text())


def engines(args, prompts: list[dict]) -> list[tuple[str, dict, str, dict]]:
    """(engine, job, python, environment) of every engine the run has."""
    import mlx_spec  # noqa: F401  (the conversion below needs the package's fixes)
    from mlx_spec import catalog

    known = catalog.known(args.model)
    folder = catalog.model_dir(known)
    gguf = catalog.installed_gguf(known) or catalog.fetched_gguf(known)
    base = {"prompts": prompts, "max_tokens": args.max_tokens, "seed": args.seed,
            "temperatures": args.temperatures}  # fmt: skip
    out = [("mlx-spec", {**base, "model": args.model, "modes": args.modes}, sys.executable, {})]
    if "mlx-lm" in args.peers:
        modes = ["plain", "spec"] if (folder / "draft" / "config.json").is_file() else ["plain"]
        job = {**base, "model_dir": str(folder), "draft_dir": str(folder / "draft"),
               "modes": modes, "k": args.mlx_lm_k}  # fmt: skip
        out.append(("mlx-lm", job, sys.executable, {"LD_PRELOAD": OPENBLAS}))
    if args.llama_python:
        job = {**base, "gguf": str(gguf), "modes": ["plain", "lookup2", "lookup10"]}
        out.append(("llama-cpp-python", job, args.llama_python,
                    {"LLAMA_CPP_LIB_PATH": args.llama_lib or ""}))  # fmt: skip
    if args.llama_server:
        modes = {"plain": [], "ngram-simple": ["--spec-type", "ngram-simple"],
                 "ngram-mod": ["--spec-type", "ngram-mod"]}  # fmt: skip
        if args.draft_gguf:
            modes["draft"] = ["--spec-type", "draft-simple", "-md", args.draft_gguf,
                              "--spec-draft-n-max", "8", "-td", "2"]  # fmt: skip
        job = {**base, "gguf": str(gguf), "server": args.llama_server, "modes": list(modes),
               "server_modes": modes}  # fmt: skip
        out.append(("llama-server", job, sys.executable, {}))
    return out


def summarize(rows: list[dict], prompts: list[dict]) -> dict:
    """Per engine, mode and temperature: decode tokens/s, speedup over the engine's plain
    decoding (geometric mean over prompts, by kind and overall; the lowest prompt), greedy
    outputs equal to plain decoding's, acceptance by position and mean accepted length."""
    kind = {p["id"]: p["kind"] for p in prompts}
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        cells.setdefault(
            (row["engine"], row["mode"], row["temperature"], row["prompt"]), []
        ).append(row)
    median = {
        key: statistics.median(r["decode_tps"] or 0.0 for r in runs) for key, runs in cells.items()
    }
    out: dict = {}
    for (engine, mode, temperature, prompt), runs in cells.items():
        plain = median.get((engine, "plain", temperature, prompt))
        entry = out.setdefault(f"{engine}/{mode}/T={temperature}", {"speedups": {}, "tps": {}})
        entry["tps"][prompt] = median[(engine, mode, temperature, prompt)]
        if plain:
            entry["speedups"][prompt] = median[(engine, mode, temperature, prompt)] / plain
        if temperature == 0:
            base = cells.get((engine, "plain", temperature, prompt), [{}])[0].get("tokens")
            same = all(r["tokens"] == base for r in runs) if base is not None else None
            entry.setdefault("greedy_same", {})[prompt] = same
        if "acceptance_by_position" in runs[0]:
            drafted = [0] * 8
            accepted = [0.0] * 8
            for r in runs:
                for i, (a, d) in enumerate(
                    zip(r["acceptance_by_position"], r["drafted_per_position"], strict=False)
                ):
                    if i < 8:
                        drafted[i] += d
                        accepted[i] += a * d
            entry.setdefault("_acc", [[0] * 8, [0.0] * 8])
            for i in range(8):
                entry["_acc"][0][i] += drafted[i]
                entry["_acc"][1][i] += accepted[i]
            entry.setdefault("_mal", []).extend(r["mean_accepted_length"] for r in runs)
    for entry in out.values():
        speedups = entry["speedups"]
        entry["speedup_geomean"] = _geomean(speedups.values())
        entry["speedup_min"] = min(speedups.values()) if speedups else None
        entry["speedup_by_kind"] = {
            k: _geomean(v for p, v in speedups.items() if kind[p] == k)
            for k in sorted(set(kind.values()))
        }
        entry["tps_mean"] = statistics.mean(entry["tps"].values())
        if "greedy_same" in entry:
            entry["greedy_same_prompts"] = sum(bool(v) for v in entry["greedy_same"].values())
        if "_acc" in entry:
            drafted, accepted = entry.pop("_acc")
            entry["acceptance_by_position"] = [
                a / d if d else None for a, d in zip(accepted, drafted, strict=False)
            ]
            entry["mean_accepted_length"] = statistics.mean(entry.pop("_mal"))
    return out


def _geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(statistics.mean(math.log(v) for v in values)) if values else None


def markdown(summary: dict, prompts: list[dict]) -> str:
    kinds = sorted({p["kind"] for p in prompts})
    head = (
        "| engine / mode / T | tok/s | speedup | "
        + " | ".join(kinds)
        + " | lowest | greedy = plain |"
    )
    lines = [head, "|" + " --- |" * (5 + len(kinds))]
    for name, e in sorted(summary.items()):
        by_kind = " | ".join(
            f"{e['speedup_by_kind'][k]:.2f}" if e["speedup_by_kind"][k] else "-" for k in kinds
        )
        same = f"{e['greedy_same_prompts']}/{len(e['greedy_same'])}" if "greedy_same" in e else "-"
        speed = f"{e['speedup_geomean']:.2f}" if e["speedup_geomean"] else "-"
        low = f"{e['speedup_min']:.2f}" if e["speedup_min"] else "-"
        lines.append(f"| {name} | {e['tps_mean']:.1f} | {speed} | {by_kind} | {low} | {same} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        engine, job_file, out_file = sys.argv[2:5]
        rows = WORKERS[engine](json.loads(Path(job_file).read_text()))
        Path(out_file).write_text(json.dumps(rows))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=Path, default=PROMPTS)
    parser.add_argument("--per-kind", type=int, help="only the first N prompts of each kind")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=lambda s: [float(t) for t in s.split(",")],
                        default=[0.0, 0.7])  # fmt: skip
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    parser.add_argument("--peers", type=lambda s: s.split(","), default=["mlx-lm"])
    parser.add_argument(
        "--mlx-lm-k", type=int, default=3, help="mlx-lm's draft tokens (its default)"
    )
    parser.add_argument("--llama-python", help="python of an environment with llama-cpp-python")
    parser.add_argument("--llama-lib", help="folder of the libllama.so that python loads")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    parser.add_argument("--draft-gguf", help="the draft model as GGUF for llama-server")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    args = parser.parse_args()
    prompts = chat_prompts(args.prompts, args.model, args.per_kind)
    plan = engines(args, prompts)
    rows = []
    for repeat in range(args.repeats):
        shift = repeat % len(plan)
        for engine, job, python, env in plan[shift:] + plan[:shift]:
            tic = time.perf_counter()
            got = run_worker(engine, {**job, "seed": args.seed + 1000 * repeat}, python, env)
            for row in got:
                row["repeat"] = repeat
            rows += got
            print(f"repeat {repeat}: {engine} {time.perf_counter() - tic:.0f} s", file=sys.stderr)
    summary = summarize(rows, prompts)
    print(markdown(summary, prompts))
    if args.json:
        record = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "prompts": [{k: p[k] for k in ("id", "kind")} for p in prompts],
                  "summary": summary, "runs": rows}  # fmt: skip
        args.json.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
