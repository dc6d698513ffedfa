"""A target sharded over 2 processes on loopback (MLX's ring backend), every process started
here with MLX_RANK and MLX_HOSTFILE as `mlx.launch` starts them, each run bounded by a timeout.

Lossless: greedy output on 2 ranks equals single-process plain decoding for a draft model,
n-gram lookup and an MTP head, tensor and pipeline parallel; the first three tokens sampled on
2 ranks follow the target's exact distribution. Robust: a rank that dies makes the other exit
with a one-line error; ranks that load different models, a drafter that needs hidden states a
pipeline stage does not have, and `--shard` without a launcher get one-line errors.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx_spec
from convert import convert_checkpoint
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.serving.server import ServerConfig, create_app, drafter_factories

import hfmodels as hfm
import httpx
import pytest
import tinymodels as tm
from chisquare import chisquare_pvalue, exact_first_tokens
from conftest import serving
from helpers import cli_here, write_eagle3

WORKER = Path(__file__).with_name("distributed_worker.py")
PROMPT = [3, 4, 5, 19, 6, 3, 4, 9, 11]
TIMEOUT = 240  # seconds any 2-rank run may take at most (a hang fails, it never blocks)


def qwen2_config(**overrides) -> dict:
    """4 layers: mlx-lm has both tensor parallelism and pipeline stages for qwen2."""
    config = tm.llama_config(tm.tokenizer_size(), model_type="qwen2", num_hidden_layers=4)
    config.update(max_position_embeddings=4096, **overrides)
    return config


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Checkpoints: a qwen2 target, a noisy copy as its draft model, a second qwen2 (another
    model), one that never ends (no reachable EOS), a gemma3 (which mlx-lm cannot split), an
    EAGLE-3 head for the target, and a converted DeepSeek-V3 with its MTP head."""
    root = tmp_path_factory.mktemp("dist")
    config = qwen2_config()
    weights = tm.random_weights(config, seed=31)
    out = {
        "target": tm.write_checkpoint(root / "target", config, weights),
        "draft": tm.write_checkpoint(root / "draft", config, tm.perturb(weights, 0.3, seed=32)),
        "other": tm.write_checkpoint(
            root / "other", qwen2_config(), tm.random_weights(config, seed=33)
        ),
    }
    # its EOS id is beyond the tokenizer's vocabulary: it generates to --max-tokens
    endless = qwen2_config(vocab_size=tm.tokenizer_size() + 3, eos_token_id=tm.tokenizer_size() + 2)
    out["endless"] = tm.write_checkpoint(
        root / "endless", endless, tm.random_weights(endless, seed=34)
    )
    tokenizer_config = json.loads((out["endless"] / "tokenizer_config.json").read_text())
    del tokenizer_config["eos_token"]  # </s> is an ordinary token here
    (out["endless"] / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    gemma = tm.gemma3_config(tm.tokenizer_size())
    out["gemma3"] = tm.write_checkpoint(root / "gemma3", gemma, tm.random_weights(gemma, seed=35))
    out["eagle3"] = write_eagle3(root / "eagle3")[0]
    source, _ = hfm.write_hf_checkpoint(root / "deepseek_v3", "deepseek_v3", seed=4)
    hfm.add_mtp(source, family="deepseek_v3", seed=50)
    out["deepseek_v3"] = convert_checkpoint(
        str(source), str(root / "deepseek_v3-mlx"), dtype="float32"
    ).path
    return out


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start(argvs: list[list[str]], tmp_path: Path, **popen) -> list[subprocess.Popen]:
    """One process per rank (argvs[r] for rank r), joined by a ring hostfile on loopback."""
    hostfile = tmp_path / f"hosts-{time.monotonic_ns()}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(len(argvs))]))
    procs = []
    for rank, argv in enumerate(argvs):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                **popen,
            )  # fmt: skip
        )
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of every rank; kills them all past `timeout` and fails."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            out.append((p.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a 2-rank run took more than {timeout} s")
    return out


def run_job(tmp_path: Path, job: dict) -> list[dict]:
    """The worker's record from each of 2 ranks."""
    path = tmp_path / f"job-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(job))
    results = finish(start([[str(WORKER), str(path)]] * 2, tmp_path))
    records = []
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
        records.append(json.loads(stdout.strip().splitlines()[-1]))
    return records


CASES = [  # (model, shard, [(drafter, num_draft)]): one 2-rank job runs them in turn
    ("target", "tensor", [("draft", 3), ("ngram", "auto")]),
    ("target", "pipeline", [("draft", "auto"), ("ngram", 4)]),
    ("deepseek_v3", "tensor", [("mtp", 2)]),
    ("deepseek_v3", "pipeline", [("mtp", "auto")]),
]


@pytest.mark.parametrize(
    "model,shard,drafters",
    CASES,
    ids=lambda c: "+".join(d for d, _ in c) if isinstance(c, list) else c,
)
def test_greedy_on_two_ranks_equals_plain_decoding(ckpt, tmp_path, model, shard, drafters):
    target, tokenizer = mlx_spec.load(str(ckpt[model]))
    tokenizer.eos_token_ids = set()
    plain = mlx_spec.generate(target, tokenizer, PROMPT, max_tokens=40).tokens
    specs = [str(ckpt["draft"]) if name == "draft" else name for name, _ in drafters]
    job = {
        "model": str(ckpt[model]), "prompt": PROMPT, "max_tokens": 40, "shard": shard,
        "drafter": specs, "num_draft": [k for _, k in drafters], "runs": len(drafters),
    }  # fmt: skip
    ranks = run_job(tmp_path, job)
    for rank, record in enumerate(ranks):
        assert record["rank"] == rank and record["world_size"] == 2
        for (name, _), tokens, stats in zip(
            drafters, record["tokens"], record["run_stats"], strict=True
        ):
            assert tokens == plain, f"rank {rank} ({shard}, {name})"
            assert stats["drafted_tokens"] > 0 and stats["comm_collectives"] > 0
            assert stats["comm_seconds_per_pass"] > 0
    # every rank counted the same rounds: they rolled back alike
    for first, second in zip(ranks[0]["run_stats"], ranks[1]["run_stats"], strict=True):
        assert first["target_passes"] == second["target_passes"]


def test_plain_and_speculative_generations_in_turn(ckpt, tmp_path):
    """Plain decoding (mlx-lm's pipelined steps, on a stream of their own) and speculative
    rounds one generation after the other on the same sharded target: every generation
    equals plain decoding (the ranks' collectives stay paired across the switches)."""
    target, tokenizer = mlx_spec.load(str(ckpt["target"]))
    tokenizer.eos_token_ids = set()
    plain = mlx_spec.generate(target, tokenizer, PROMPT, max_tokens=24).tokens
    job = {
        "model": str(ckpt["target"]), "shard": "tensor", "prompt": PROMPT, "max_tokens": 24,
        "drafter": ["none", "ngram", "none", str(ckpt["draft"])], "runs": 8,
    }  # fmt: skip
    for record in run_job(tmp_path, job):
        assert record["tokens"] == [plain] * 8


def test_sampled_tokens_on_two_ranks_follow_the_target(ckpt, tmp_path):
    """The first three tokens of 300 seeded generations (temperature 1, top-k 3, the draft
    model verified by rejection sampling on a tensor-parallel target) against the target's
    exact distribution; every rank saw the same samples."""
    config = SamplingConfig(temperature=1.0, top_k=3)
    job = {
        "model": str(ckpt["target"]), "shard": "tensor", "drafter": str(ckpt["draft"]),
        "num_draft": 2, "prompt": PROMPT, "max_tokens": 3, "temperature": 1.0, "top_k": 3,
        "runs": 300, "seed": 0,
    }  # fmt: skip
    ranks = run_job(tmp_path, job)
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    model, _ = mlx_spec.load(str(ckpt["target"]))
    exact = exact_first_tokens(model, PROMPT, config, tm.tokenizer_size())
    samples = [tuple(t) for t in ranks[0]["tokens"]]
    assert chisquare_pvalue(samples, exact) > 1e-3
    assert ranks[0]["accepted"] > 0  # rejection sampling accepted drafts, and rejected some
    # negative control: a verifier that accepts every draft fails the same test, already at a
    # third of the runs (a sample outside the target's top-k there: p = 0)
    broken = run_job(tmp_path, {**job, "negative_control": "gross", "runs": 100})
    assert chisquare_pvalue([tuple(t) for t in broken[0]["tokens"]], exact) < 1e-3


def cli(*args: str) -> list[str]:
    return ["-m", "mlx_spec.cli", *args]


def test_cli_generate_on_two_ranks(ckpt, tmp_path):
    """Rank 0 prints the JSON record (world_size 2, communication per pass); rank 1 prints
    nothing at all; the tokens are plain decoding's."""
    args = ["generate", "--model", str(ckpt["target"]), "--prompt", "abcab", "--max-tokens",
            "24", "--draft-model", str(ckpt["draft"]), "--json"]  # fmt: skip
    plain = subprocess.run(
        [sys.executable, *cli(*args[:-3], "--json")], capture_output=True, text=True,
        timeout=TIMEOUT,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    (zero, out0, err0), (one, out1, err1) = finish(
        start([cli(*args, "--shard", "tensor")] * 2, tmp_path)
    )
    assert zero == 0 and one == 0, err0 + err1
    record = json.loads(out0)
    assert record["tokens"] == json.loads(plain.stdout)["tokens"]
    assert record["stats"]["world_size"] == 2 and record["stats"]["comm_seconds_per_pass"] > 0
    assert out1 == "" and err1 == ""


def test_a_lost_rank_stops_the_others(ckpt, tmp_path):
    """Rank 1 is killed mid-generation: rank 0 exits with a one-line error, well within the
    time the generation would have taken."""
    args = cli("generate", "--model", str(ckpt["endless"]), "--prompt", "abc", "--max-tokens",
               "3000", "--ngram")  # fmt: skip
    procs = start([args, args], tmp_path, bufsize=0)
    tic = time.monotonic()
    assert procs[0].stdout.read(1), "rank 0 printed nothing"  # generation is under way
    procs[1].kill()
    (code, stdout, stderr), _ = finish(procs, timeout=60)
    assert len(stdout) < 2000, "the generation ended before rank 1 was lost"
    assert code == 1 and time.monotonic() - tic < 60
    lines = [line for line in stderr.splitlines() if line.startswith("mlx-spec: error")]
    assert len(lines) == 1 and "rank 0: a rank of the distributed run was lost" in lines[0]
    assert "Traceback" not in stderr


def test_bad_setups_get_one_line_errors(ckpt, tmp_path):
    target, other = str(ckpt["target"]), str(ckpt["other"])
    # ranks that loaded different models
    base = ["generate", "--prompt", "abc", "--max-tokens", "4", "--ngram"]
    results = finish(start([cli(*base, "--model", target), cli(*base, "--model", other)], tmp_path))
    for code, _, stderr in results:
        assert code == 2 and "Traceback" not in stderr
        assert "ranks 1 loaded a different model than rank 0" in stderr
    # an EAGLE-3 head reads inner layers, which a pipeline spreads over the ranks
    args = cli(*base[:-1], "--model", target, "--eagle", str(ckpt["eagle3"]), "--shard",
               "pipeline")  # fmt: skip
    for code, _, stderr in finish(start([args, args], tmp_path)):
        assert code == 2 and "Traceback" not in stderr
        assert "hidden states at layers" in stderr and "--shard tensor" in stderr
    # an architecture mlx-lm can neither shard nor pipeline
    args = cli(*base, "--model", str(ckpt["gemma3"]))
    for code, _, stderr in finish(start([args, args], tmp_path)):
        assert code == 2 and "Traceback" not in stderr
        assert "cannot shard gemma3_text: mlx-lm has neither" in stderr
    # --shard needs a launcher
    alone = cli_here(*base, "--model", target, "--shard", "tensor")
    assert alone.returncode == 2 and "mlx.launch" in alone.stderr


def wait_for_health(url: str, procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            errors = "".join(p.stderr.read() for p in procs)
            pytest.fail(f"a rank of the server exited:\n{errors[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    for p in procs:
        p.kill()
    pytest.fail("the 2-rank server did not start")


@pytest.mark.parametrize(
    "shard,batching", [("tensor", True), ("pipeline", True), ("tensor", False)]
)
def test_serve_on_two_ranks(ckpt, tmp_path, shard, batching):
    """`mlx-spec serve` on 2 ranks: rank 0 answers; concurrent requests of different lengths
    (plain, the draft model at a fixed k, n-gram lookup chosen by the policy) run as one
    batch on the sharded target and each equals single-process plain decoding; a client that
    leaves mid-stream frees its row on every rank; a seeded sampled request is reproducible;
    stopping rank 0 stops the other rank cleanly, which printed nothing. Without batching the
    requests are solo streams advanced in turn, in the same order on both ranks."""
    (port,) = _free_ports(1)
    url = f"http://127.0.0.1:{port}"
    args = cli("serve", "--model", str(ckpt["target"]), "--draft-model", str(ckpt["draft"]),
               "--port", str(port), "--shard", shard, "--max-tokens-limit", "64")  # fmt: skip
    args += [] if batching else ["--no-batching"]
    procs = start([args, args], tmp_path)
    try:
        wait_for_health(url, procs)
        target, tokenizer = mlx_spec.load(str(ckpt["target"]))
        prompts = [PROMPT, PROMPT[2:], [7, 8, 9, 7, 8, 9, 7], PROMPT[::-1], [5, 6]]
        lengths = [30, 9, 24, 17, 5]
        options = [None, {"drafter": "draft-model", "num_draft": 3}, {"drafter": "ngram"},
                   {"drafter": "draft-model", "num_draft": "auto"}, {"enabled": False}]  # fmt: skip

        def ask(i: int):
            body = {"model": "target", "prompt": prompts[i], "max_tokens": lengths[i],
                    "temperature": 0}  # fmt: skip
            if options[i] is not None:
                body["speculative"] = {"enabled": True, **options[i]}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()

        def left_midway() -> None:  # a client that reads one event and hangs up
            body = {"model": "target", "prompt": PROMPT, "max_tokens": 60, "stream": True,
                    "speculative": {"enabled": True, "drafter": "ngram"}}  # fmt: skip
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
                next(r.iter_lines())

        with ThreadPoolExecutor(6) as pool:
            gone = pool.submit(left_midway)
            replies = list(pool.map(ask, range(len(prompts))))
            gone.result()
        for i, reply in enumerate(replies):
            plain = mlx_spec.generate(target, tokenizer, prompts[i], max_tokens=lengths[i])
            assert reply["choices"][0]["text"] == plain.text, (i, reply)
        for reply in replies:
            assert reply["usage"]["speculative"]["world_size"] == 2
        assert replies[1]["usage"]["speculative"]["drafted_tokens"] > 0
        spec = {"drafter": "draft-model", "num_draft": 2}  # a fixed k: its draws are its own
        sampled = {"model": "target", "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0,
                   "seed": 7, "speculative": spec}  # fmt: skip
        texts = [httpx.post(f"{url}/v1/completions", json=sampled, timeout=TIMEOUT).json()
                 for _ in range(2)]  # fmt: skip
        assert texts[0]["choices"][0]["text"] == texts[1]["choices"][0]["text"]
        # ... and it is the text one process serves for it: the sharded engine samples as the
        # single-process one does (whose distribution tests, negative controls included, cover
        # the batched verifier)
        drafters = drafter_factories(target, tokenizer, draft_model=str(ckpt["draft"]))
        config = ServerConfig(model_id="target", batching=batching, max_tokens_limit=64)
        with serving(create_app(target, tokenizer, config, drafters)) as alone:
            one = httpx.post(f"{alone}/v1/completions", json=sampled, timeout=TIMEOUT).json()
        assert one["choices"][0]["text"] == texts[0]["choices"][0]["text"]
        health = httpx.get(f"{url}/health", timeout=10).json()
        # the client that left is cancelled (or had finished first, when the row was fast)
        assert health["active"] == 0 and health["failed"] == 0
        assert health["completed"] + health["cancelled"] == len(prompts) + 3
        assert health["world_size"] == 2 and health["batching"] is batching
    finally:
        procs[0].send_signal(signal.SIGINT)
        (zero, _, err0), (one, out1, err1) = finish(procs, timeout=60)
    assert zero == 0 and one == 0, err0[-2000:] + err1[-2000:]
    assert out1 == "" and err1 == ""


def test_a_server_that_loses_a_rank_stops(ckpt, tmp_path):
    """Rank 1 of a 2-rank server is killed: the next request gets a 503 saying so, and rank 0
    exits with one line (no traceback) instead of serving requests it can no longer run."""
    (port,) = _free_ports(1)
    url = f"http://127.0.0.1:{port}"
    args = cli("serve", "--model", str(ckpt["target"]), "--port", str(port), "--shard", "tensor")
    procs = start([args, args], tmp_path)
    wait_for_health(url, procs)
    procs[1].kill()
    body = {"model": "target", "prompt": "abc", "max_tokens": 8}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 503 and "a rank of the distributed run was lost" in reply.text
    (code, _, stderr), _ = finish(procs, timeout=30)
    lines = [line for line in stderr.splitlines() if line.startswith("mlx-spec: error")]
    assert (
        code == 1
        and len(lines) == 1
        and "rank 0: a rank of the distributed run was lost" in lines[0]
    )
    assert "Traceback" not in stderr


def test_drafters_a_sharded_target_cannot_run_are_refused():
    """A drafter attending over the target's K/V cache (a Gemma 4 assistant), alone or in a
    group, is refused on a sharded target in one line; other drafters and unsharded targets
    pass."""
    from types import SimpleNamespace

    from mlx_spec.decoding import distributed

    import mlx.core as mx
    import mlx.nn as nn

    model = nn.Module()
    reader = SimpleNamespace(name="gemma4-assistant", reads_target_cache=True)
    plain = SimpleNamespace(name="draft-model")
    group = SimpleNamespace(name="all", drafters=[plain, reader])
    distributed.check_drafter(model, reader, ())  # one process: nothing is split
    sharding = distributed.Sharding(mx.distributed.init(), "tensor")
    object.__setattr__(model, distributed.SHARDING_ATTR, sharding)
    distributed.check_drafter(model, plain, ())
    for drafter in (reader, group):
        with pytest.raises(ValueError, match="gemma4-assistant attends over the target's own"):
            distributed.check_drafter(model, drafter, ())
