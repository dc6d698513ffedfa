"""EAGLE-3 heads and DFlash drafters inside the batching engine (and so the server): the
batched drafters after ragged rows, forced outcomes, plain stretches and a prompt-cache rejoin
draft what a fresh single-stream drafter drafts on the same sequence; greedy rows in a busy
batch (each drafter, and every drafter at once, so a row keeps only the features its drafters
read) equal plain decoding; rows sampled inside a batch keep the target's distribution (the
batched q equals the single-stream q, pinned by the first test; the batch verifier's negative
controls are in test_batch.py); and the server runs their requests as batch rows."""

from __future__ import annotations

import asyncio
import random

import mlx_spec
from convert import convert_checkpoint
from mlx_spec.caches.prompt_cache import RowCache
from mlx_spec.core.batch_verify import RowRandom
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.drafters.batch import BatchDFlash, BatchEagle3, BatchNgram
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.drafters.eagle3 import Eagle3Drafter
from mlx_spec.serving.server import ServerConfig, create_app, drafter_factories

import hfmodels as hfm
import httpx
import mlx.core as mx
import numpy as np
import pytest
from chisquare import chisquare_pvalue, exact_sequences, reference_probs
from conftest import serving
from helpers import busy_requests, engine_for, run_all, with_eos, write_dflash, write_eagle3

PROMPT = [3, 4, 5, 19, 6, 3, 4, 9, 11]
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 4-layer Llama (float32) with an EAGLE-3 head (its own half of the vocabulary, read
    from the EAGLE layout) and a DFlash drafter (z-lab's layout), both written to disk."""
    root = tmp_path_factory.mktemp("batch-features")
    source, _ = hfm.write_hf_checkpoint(root / "llama", "llama", seed=1, num_hidden_layers=4)
    path = convert_checkpoint(str(source), str(root / "llama-mlx"), dtype="float32").path
    model, tok = mlx_spec.load(str(path))
    eagle_dir, _ = write_eagle3(root / "eagle3", "eagle3")
    dflash_dir, _ = write_dflash(root / "dflash")
    eagle = mlx_spec.load_eagle3_drafter(str(eagle_dir), model)
    dflash = mlx_spec.load_dflash_drafter(str(dflash_dir), model)
    return model, with_eos(tok), eagle, dflash, eagle_dir, dflash_dir


def batched(kind, eagle, dflash):
    return BatchEagle3(eagle.module) if kind == "eagle3" else BatchDFlash(dflash.model)


def fresh_draft(kind, eagle, dflash, model, sequence, k, config=GREEDY):
    """A brand-new single-stream drafter's draft on `sequence` (the last token pending)."""
    drafter = (
        Eagle3Drafter(eagle.module, model)
        if kind == "eagle3"
        else DFlashDrafter(dflash.model, model)
    )
    runner = ModelRunner(model, hfm.VOCAB, keep_hidden=drafter.hidden_layers)
    drafter.begin(sequence, hfm.VOCAB, runner.prefill(sequence[:-1]))
    return drafter.draft(k, config)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_batched_drafter_equals_a_fresh_single_stream_one(setup, kind):
    """Three rows of different lengths: rounds forced to keep 0, 1 or every draft (each row
    its own outcome), a row taking plain steps while the others draft (its features pile up),
    a row leaving and coming back with its state and a longer sequence (a prompt-cache turn).
    Every draft equals a fresh single-stream drafter's on the row's sequence: greedy tokens,
    and the first position's distribution at temperature 1."""
    model, _, eagle, dflash, _, _ = setup
    drafter = batched(kind, eagle, dflash)
    drafter.vocab = hfm.VOCAB
    layers = eagle.hidden_layers if kind == "eagle3" else dflash.hidden_layers
    rng = random.Random(5)
    seqs = {
        r: [1] + [rng.randrange(3, hfm.VOCAB) for _ in range(n)] for r, n in enumerate((4, 13, 8))
    }
    runners = {}

    def join(row, common=0, state=None):
        runners[row] = ModelRunner(model, hfm.VOCAB, keep_hidden=layers)
        hidden = runners[row].prefill(seqs[row][:-1])
        drafter.join(row, seqs[row], hidden, state, common)

    for row in seqs:
        join(row)
    hot = SamplingConfig(temperature=1.0)
    for step in range(8):
        ks = {0: 3, 1: 0 if step in (1, 2, 3) else 2, 2: 1 + step % 3}
        config = GREEDY if step % 2 == 0 else hot  # greedy: tokens; hot: distributions
        randoms = {r: None if config.greedy else RowRandom(r) for r in seqs}
        block = drafter.draft(ks, {r: config for r in seqs}, randoms)
        for i, row in enumerate(block.rows):
            k = block.counts[i]
            if not k:
                continue
            want = fresh_draft(kind, eagle, dflash, model, seqs[row], k, config)
            if config.greedy:
                assert block.tokens[i, :k].tolist() == want.tokens.tolist(), (step, row)
            else:  # DFlash's positions do not depend on the tokens drawn before them
                upto = k if kind == "dflash" else 1
                got = np.array(block.probs[i, :upto, : hfm.VOCAB])
                np.testing.assert_allclose(got, np.array(want.probs[:upto]), atol=1e-5)
        for i, row in enumerate(block.rows):
            k = block.counts[i]
            drafts = block.tokens[i, :k].tolist()
            kept = (0, 1, k)[(step + row) % 3] if k else 0
            emitted = drafts[:kept] + [(drafts[kept] + 1) % hfm.VOCAB if kept < k else 5]
            if not k:
                emitted = [rng.randrange(3, hfm.VOCAB)]
            runners[row](mx.array([seqs[row][-1]] + emitted[:-1], mx.uint32))
            drafter.accept(row, k, kept, emitted, runners[row].last_hidden)
            seqs[row] += emitted
        if step == 4:  # row 1 leaves; its next turn shares its whole sequence
            state = drafter.leave(1)
            common = len(seqs[1])
            seqs[1] = seqs[1] + [7, 8, 9]
            join(1, common, state)
    assert sorted(drafter.rows) == [0, 1, 2]


def engine_with_both(setup, **kwargs):
    model, tok, eagle, dflash, _, _ = setup
    drafters = {
        "ngram": BatchNgram(),
        "eagle3": BatchEagle3(eagle.module),
        "dflash": BatchDFlash(dflash.model),
    }
    return engine_for(model, tok, drafters, **kwargs)


@pytest.mark.parametrize("num_draft", ["auto", 3])
def test_greedy_rows_equal_plain_decoding(setup, num_draft):
    """Seven requests of different lengths through a batch of four, drafting with the EAGLE-3
    head, the DFlash drafter and all drafters at once (rows of different drafters side by
    side: each keeps only its drafters' features): each equals plain single-stream decoding."""
    model, tok = setup[:2]
    engine = engine_with_both(setup, max_batch=4, prefill_step=16, row_cache=RowCache())
    kinds = engine.features.kinds
    assert len(kinds) == 2 and engine.features.widths[kinds[0]] != engine.features.widths[kinds[1]]
    requests = []
    for i, drafter in enumerate(["eagle3", "dflash", "all"]):
        for req in busy_requests(hfm.VOCAB, drafter, num_draft)[i::2]:
            requests.append(req)
    results = run_all(engine, requests)
    drafted = {}
    for req, (tokens, final) in zip(requests, results, strict=True):
        plain = mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"])
        assert tokens == plain.tokens, req["drafter"]
        drafted[req["drafter"]] = drafted.get(req["drafter"], 0) + final.stats.drafted
    assert all(drafted.values()), drafted
    assert engine.cache is None and all(not d.rows for d in engine.drafters.values())


@pytest.mark.parametrize("drafter", ["eagle3", "dflash"])
def test_conversation_turn_reuses_the_features(setup, drafter):
    """A conversation's next turn takes the entry its first turn left (its target cache, its
    drafter's state and its features), prefills only what is new and answers as from
    scratch; a row of the other drafter (other features) never takes that entry."""
    model, tok = setup[:2]
    engine = engine_with_both(setup, row_cache=RowCache())
    first = [1, 4, 5, 6, 7, 8, 9, 10, 11]
    ask = dict(sampling=GREEDY, max_tokens=12, drafter=drafter, num_draft=3)
    ((reply, _),) = run_all(engine, [dict(ask, prompt=first)])
    second = first + reply + [12, 13]
    other = "dflash" if drafter == "eagle3" else "eagle3"
    ((_, final),) = run_all(engine, [dict(ask, prompt=second, drafter=other)])
    assert final.stats.cached_tokens == 0
    ((tokens, final),) = run_all(engine, [dict(ask, prompt=second)])
    assert final.stats.cached_tokens == len(first) + len(reply) - 1
    assert final.stats.drafted > 0
    assert tokens == mlx_spec.generate(model, tok, second, max_tokens=12).tokens


@pytest.mark.parametrize("drafter", ["eagle3", "dflash"])
def test_an_entry_of_every_drafter_serves_a_row_of_one(setup, drafter):
    """A turn answered with every drafter keeps both kinds of features; the next turn,
    drafting with one drafter, takes that entry (the columns of its own kind), prefills only
    what is new and answers as from scratch. The entry it leaves holds one kind, so a row of
    every drafter finds nothing to take."""
    model, tok = setup[:2]
    engine = engine_with_both(setup, row_cache=RowCache())
    first = [1, 4, 5, 6, 7, 8, 9, 10, 11]
    ask = dict(sampling=GREEDY, max_tokens=12, num_draft=3)
    ((reply, _),) = run_all(engine, [dict(ask, prompt=first, drafter="all")])
    (entry,) = engine.row_cache
    assert len(entry.features) == 2
    second = first + reply + [12, 13]
    ((tokens, final),) = run_all(engine, [dict(ask, prompt=second, drafter=drafter)])
    assert final.stats.cached_tokens == len(first) + len(reply) - 1
    assert final.stats.drafted > 0
    assert tokens == mlx_spec.generate(model, tok, second, max_tokens=12).tokens
    (entry,) = engine.row_cache
    assert entry.features == engine.features.of([drafter])
    assert entry.hidden.shape[-1] == engine.features.row_bytes(entry.features) // 4
    third = second + tokens + [14]
    ((_, final),) = run_all(engine, [dict(ask, prompt=third, drafter="all")])
    assert final.stats.cached_tokens == 0


DIST = SamplingConfig(temperature=1.0, top_k=3)
RUNS = 1000
LENGTH = 4  # the first token comes from the prefill; one round of k = 2 can emit the rest


def exact_first_tokens(model) -> dict:
    """The target's exact distribution of its first LENGTH sampled tokens after PROMPT."""

    def next_probs(ids):
        return reference_probs(np.array(model(mx.array([ids]))[0, -1, : hfm.VOCAB]), DIST)

    return exact_sequences(next_probs, PROMPT, LENGTH)


def batched_first_tokens(setup, drafter: str) -> list:
    """The first LENGTH tokens of RUNS seeded rows drafting with k = 2, in batches of 50
    beside greedy rows of the other drafters."""
    engine = engine_with_both(setup, max_batch=50, prefill_step=4096)
    ask = dict(prompt=PROMPT, sampling=DIST, max_tokens=LENGTH, drafter=drafter, num_draft=2)
    requests = []
    for seed in range(RUNS):
        requests.append(dict(ask, seed=seed))
        if seed % 10 == 0:
            other = "dflash" if drafter == "eagle3" else "all"
            requests.append(dict(prompt=[1, 3, 5], sampling=GREEDY, max_tokens=5, drafter=other))
    results = run_all(engine, requests)
    return [
        tuple(tokens)
        for req, (tokens, _) in zip(requests, results, strict=True)
        if req["prompt"] == PROMPT
    ]


@pytest.mark.parametrize("drafter", ["eagle3", "dflash"])
def test_batched_rows_keep_the_distribution(setup, drafter):
    """Temperature 1, top-k 3: rows sampled inside busy batches, drafting with the EAGLE-3
    head (q zero outside its half of the vocabulary) or DFlash blocks (each position its own
    q), follow the target's exact distribution of four tokens."""
    model = setup[0]
    samples = batched_first_tokens(setup, drafter)
    assert len(samples) == RUNS
    assert chisquare_pvalue(samples, exact_first_tokens(model)) > 1e-3


def test_server_batches_eagle3_and_dflash_requests(setup):
    """`serve --eagle --dflash`: both drafters join the batch engine (their requests are batch
    rows, not solo streams); concurrent streaming requests of each (and of every drafter at
    once) equal plain greedy decoding and report drafted tokens."""
    model, tok, _, _, eagle_dir, dflash_dir = setup
    factories = drafter_factories(model, tok, eagle=str(eagle_dir), dflash=str(dflash_dir))
    config = ServerConfig(model_id="t", num_draft=3)
    app = create_app(model, tok, config, factories)
    batch = app.state.engine.batch
    assert {"eagle3", "dflash"} <= set(batch.drafters)
    prompts = {"eagle3": "abcab", "dflash": "cabca", "all": "bbacc"}
    with serving(app) as url:

        async def ask(client, drafter, prompt):
            body = {
                "model": "t",
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "speculative": {"drafter": drafter},
            }
            reply = await client.post(f"{url}/v1/completions", json=body, timeout=120)
            reply.raise_for_status()
            return reply.json()

        async def all_at_once():
            async with httpx.AsyncClient() as client:
                return await asyncio.gather(*(ask(client, d, p) for d, p in prompts.items()))

        replies = asyncio.run(all_at_once())
        for (drafter, prompt), reply in zip(prompts.items(), replies, strict=True):
            plain = mlx_spec.generate(model, tok, prompt, max_tokens=16)
            assert reply["choices"][0]["text"] == plain.text, drafter
            assert reply["usage"]["speculative"]["drafted_tokens"] > 0, drafter
        assert batch._next_id == len(prompts)  # each request was a row of the batch


def test_one_token_prompts(setup):
    """Prompts of one and two tokens (no context yet for the drafter) draft and equal plain
    decoding, beside a longer row."""
    model, tok = setup[:2]
    engine = engine_with_both(setup, max_batch=6)
    requests = [
        dict(prompt=p, sampling=GREEDY, max_tokens=12, drafter=d, num_draft=3)
        for p in ([1], [1, 4], PROMPT)
        for d in ("eagle3", "dflash")
    ]
    for req, (tokens, final) in zip(requests, run_all(engine, requests), strict=True):
        assert tokens == mlx_spec.generate(model, tok, req["prompt"], max_tokens=12).tokens
        assert final.stats.drafted > 0
