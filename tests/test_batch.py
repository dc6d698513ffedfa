"""Continuous batching with speculation: the ragged batch cache against single-stream passes,
each request's greedy output inside a busy batch against its single-stream output (plain and
every drafter, a sliding-window target, rows joining and leaving, prompt-cache reuse), the
three-token distribution of rows sampled inside a batch (with negative controls), seeded rows
reproducible whatever runs beside them, and the batch policy's choices."""

from __future__ import annotations

import collections
import copy
import json
import random
import time

import mlx_spec
import mlx_spec.core.batch_verify
from convert import convert_checkpoint
from mlx_spec.caches.batch import BatchCache, batchable
from mlx_spec.caches.prompt_cache import RowCache
from mlx_spec.core.compat import scored_vocab
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.decoding.batch_policy import BatchChoice, BatchDraftPolicy, RowAsk, RowRecord
from mlx_spec.decoding.engine import (
    HOLD_GROWTH,
    IDLE_RESET,
    BatchEngine,
    BatchRequest,
    StepLog,
    StepTrace,
)
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.drafters.batch import BatchDraftModel, BatchMTP, BatchNgram

import hfmodels as hfm
import mlx.core as mx
import pytest
from chisquare import chisquare_pvalue
from helpers import (
    CONFIGS,
    DISTRIBUTION_LENGTH,
    DISTRIBUTION_PROMPT,
    busy_requests,
    engine_for,
    exact_distribution,
    run_all,
    with_eos,
)
from mlx_lm.models.cache import make_prompt_cache

ALPHA = 1e-3
# Rows per distribution test: more than the one-at-a-time tests take (batched rows are cheap,
# and against the subtle control the batched statistic needs them: p ~ 6e-3 at 1000 rows).
RUNS = 2000


def single_logits(model, tokens):
    return model(mx.array(tokens)[None], cache=make_prompt_cache(model))[0]


def ragged_step(model, batch: BatchCache, seqs: list[list[int]], rng, most: int, step: int):
    """One speculative-like step: row i is fed its last token and up to `most - 1` random
    ones, its logits are checked against a fresh single-stream pass, and it keeps a random
    prefix of them (plus a new last token): the cache is cut back by each row's own amount."""
    feeds = [rng.randrange(1, most + 1) for _ in seqs]
    width = max(feeds)
    chunks = [
        [s[-1]] + [rng.randrange(3, 20) for _ in range(f - 1)]
        for s, f in zip(seqs, feeds, strict=True)
    ]
    batch.begin(feeds)
    logits = model(mx.array([c + [0] * (width - len(c)) for c in chunks]), cache=batch.layers)
    batch.end(feeds)
    for i, (s, c) in enumerate(zip(seqs, chunks, strict=True)):
        ref = single_logits(model, s[:-1] + c)[-len(c) :]
        assert mx.allclose(ref, logits[i, : len(c)], atol=1e-4).item(), (step, i)
        keep = rng.randrange(1, len(c) + 1)
        s[:] = s[:-1] + c[:keep] + [rng.randrange(3, 20)]
    batch.truncate([len(s) - 1 for s in seqs])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batch_cache_matches_single_stream(loaded, family):
    """Rows fed ragged chunks, cut back by their own amounts, compacted, taken out and put back:
    every row's logits equal a fresh single-stream pass over its sequence (gemma3: past its
    sliding window of 8)."""
    model = loaded[family][0]
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 20) for _ in range(n)] for n in (5, 17, 11)]
    batch = None
    for s in seqs:
        one = BatchCache(model, 1)
        one.begin([len(s) - 1])
        model(mx.array([s[:-1]]), cache=one.layers)
        one.end([len(s) - 1])
        batch = one if batch is None else (batch.extend(one) or batch)
    for step in range(24):
        ragged_step(model, batch, seqs, rng, 4, step)
        if step % 7 == 3:
            batch.compact()
        if step == 12:  # the middle row leaves and comes back last
            one = batch.extract(1, model)
            batch.filter([0, 2])
            batch.extend(one)
            seqs[:] = [seqs[0], seqs[2], seqs[1]]
    assert batch.lengths == [len(s) - 1 for s in seqs]


def _one_row(model, seq: list[int]) -> BatchCache:
    one = BatchCache(model, 1)
    one.begin([len(seq) - 1])
    model(mx.array([seq[:-1]]), cache=one.layers)
    one.end([len(seq) - 1])
    return one


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_row_placed_where_a_row_left_matches_single_stream(loaded, family):
    """Rows that join are written into the rows that rows left (`place`), ending where the
    batch's columns end: no column more, and every row's logits equal a fresh single-stream
    pass's as steps go on (gemma3: past its sliding window of 8). A row with more columns
    than the batch uses is refused, the cache unchanged."""
    model = loaded[family][0]
    rng = random.Random(2)
    seqs = [[rng.randrange(3, 20) for _ in range(n)] for n in (12, 20, 7, 15)]
    batch = None
    for s in seqs:
        one = _one_row(model, s)
        batch = one if batch is None else (batch.extend(one) or batch)
    for step in range(30):
        ragged_step(model, batch, seqs, rng, 3, step)
        if step in (5, 17):  # rows 1 and 3 leave; two rows join in their places
            new = [[rng.randrange(3, 20) for _ in range(n)] for n in (6, 11)]
            group = _one_row(model, new[0])
            group.extend(_one_row(model, new[1]))
            columns = batch.columns
            assert batch.place([1, 3], group)
            assert batch.columns == columns
            seqs[1], seqs[3] = new
        if step == 23:  # a row longer than the batch's columns: refused
            longer = _one_row(model, [rng.randrange(3, 20) for _ in range(batch.columns + 5)])
            before = (batch.lengths, batch.columns)
            assert not batch.place([2], longer)
            assert (batch.lengths, batch.columns) == before
    assert batch.lengths == [len(s) - 1 for s in seqs]


def test_rows_rolled_back_by_their_own_amounts_leave_no_empty_columns(loaded):
    """Rows fed ragged chunks and cut back by their own amounts (a speculative step's
    rejections) keep their tokens contiguous: the columns in use stay exactly those of the
    longest row, with no compaction, and each row's logits still equal a fresh pass's. A
    cache whose rows all wrote at one shared column would have grown by the widest chunk
    every step."""
    model = loaded["llama"][0]
    rng = random.Random(1)
    seqs = [[rng.randrange(3, 20) for _ in range(n)] for n in (9, 4, 14)]
    batch = BatchCache(model, 3)
    lengths = [len(s) - 1 for s in seqs]
    width = max(lengths)
    batch.begin(lengths)
    model(mx.array([s[:-1] + [0] * (width - len(s) + 1) for s in seqs]), cache=batch.layers)
    batch.end(lengths)
    for step in range(16):
        ragged_step(model, batch, seqs, rng, 5, step)
        assert batch.columns == max(batch.lengths), (step, batch.lengths)
        assert batch.groups[None].held() == batch.lengths


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """A MiMo target with an MTP head, converted (float32)."""
    root = tmp_path_factory.mktemp("batch-mtp")
    source, _ = hfm.write_mimo_checkpoint(root / "mimo", seed=6)
    hfm.add_mtp(source, family="mimo", seed=50)
    path = convert_checkpoint(str(source), str(root / "mimo-mlx"), dtype="float32").path
    model, tok = mlx_spec.load(str(path))
    return model, with_eos(tok), mlx_spec.load_mtp_drafter(str(path), model)


def widths_after(engine: BatchEngine, step: str) -> list[tuple[int, int]]:
    """(columns in use, longest row's tokens) of the target's cache after each of the
    engine's `step` calls (`_plain_step` or `_speculative_step`)."""
    widths, real = [], getattr(engine, step)

    def recorded(rows, choice):
        real(rows, choice)
        if engine.cache is not None:
            group = engine.cache.groups[None]
            widths.append((group.idx, max(group.lengths)))

    setattr(engine, step, recorded)
    return widths


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("drafter", [None, "ngram", "draft-model", "all"])
@pytest.mark.parametrize("num_draft", ["auto", 3])
def test_greedy_rows_equal_single_stream(loaded, family, drafter, num_draft):
    """Seven requests of different lengths through a batch of four (rows join and leave
    between steps): each one's tokens equal plain single-stream decoding of its prompt."""
    model, tok, draft, _ = loaded[family]
    tok = with_eos(tok)
    drafters = {"ngram": BatchNgram(), "draft-model": BatchDraftModel(draft)}
    engine = engine_for(model, tok, drafters, max_batch=4, prefill_step=16, row_cache=RowCache())
    requests = busy_requests(scored_vocab(model, tok), drafter, num_draft)
    results = run_all(engine, requests)
    for req, (tokens, final) in zip(requests, results, strict=True):
        assert (
            tokens
            == mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"]).tokens
        )
        assert final.finish_reason == "length"
    if drafter is not None:
        assert sum(final.stats.drafted for _, final in results) > 0
    assert engine.cache is None and all(not d.rows for d in drafters.values())


@pytest.mark.parametrize("drafter", ["ngram", "all"])
def test_greedy_rows_equal_single_stream_with_the_pace_ledger(loaded, drafter):
    """With every row held to plain decoding's pace (`pace_slack=0`: any row behind holds
    back the plans that would slow it), the steps the batch takes change, its tokens do not:
    each request equals plain single-stream decoding, and rows still drafted."""
    model, tok, draft, _ = loaded["llama"]
    tok = with_eos(tok)
    drafters = {"ngram": BatchNgram(), "draft-model": BatchDraftModel(draft)}
    engine = engine_for(model, tok, drafters, max_batch=4, prefill_step=16, pace_slack=0.0)
    requests = busy_requests(scored_vocab(model, tok), drafter, "auto")
    results = run_all(engine, requests)
    for req, (tokens, _) in zip(requests, results, strict=True):
        plain = mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"])
        assert tokens == plain.tokens
    assert sum(final.stats.drafted for _, final in results) > 0


def test_engine_trace_records_each_step(loaded):
    """With `trace` set, every speculative step leaves a `StepTrace`: its rows, its drafts (at
    most the requests' k), the tokens it emitted and five spans that are never negative and
    fit in the run's time; the drafts the rows report fit in what the steps drafted. Plain
    steps (timed ones: the pipeline's) leave theirs with K = 0 and their time in `verify`.
    Each records the target cache's columns in use and the tokens its rows hold; each
    finished row leaves a `RowTrace` of its pace."""
    model, tok, draft, _ = loaded["llama"]
    engine = engine_for(model, tok, {"draft-model": BatchDraftModel(draft)}, max_batch=4)
    engine.trace, engine.row_trace = [], []
    requests = busy_requests(scored_vocab(model, tok), "draft-model", 3, n=5)
    requests += busy_requests(scored_vocab(model, tok), None, 0, n=3)
    tic = time.perf_counter()
    results = run_all(engine, requests)
    seconds = time.perf_counter() - tic
    spec = [t for t in engine.trace if t.num_draft]
    plain = [t for t in engine.trace if not t.num_draft]
    assert spec and all(1 <= t.rows <= 4 and t.num_draft <= 3 for t in spec)
    assert all(t.rows <= t.tokens <= t.rows * (1 + t.num_draft) for t in spec)
    drafted = sum(final.stats.drafted for _, final in results)
    assert 0 < drafted <= sum(t.rows * t.num_draft for t in spec)
    assert plain and all(t.tokens <= t.rows and t.verify > 0 for t in plain)
    assert all(t.draft_build == t.draft_queue == t.verify_build == t.host == 0 for t in plain)
    assert all(t.choose == 0 for t in plain) and any(t.choose > 0 for t in spec)
    spans = [[t.choose, t.draft_build, t.draft_queue, t.verify_build, t.verify, t.host]
             for t in spec]  # fmt: skip
    assert all(s >= 0 for step in spans for s in step)
    assert sum(map(sum, spans)) + sum(t.verify for t in plain) < seconds
    assert sum(t.tokens for t in engine.trace) < sum(len(tokens) for tokens, _ in results)
    # The cache's columns hold at least its rows' tokens (a row's, on average), and more
    # where rows are out of step or rejected drafts left columns empty.
    assert all(0 < t.held <= t.columns for t in engine.trace)
    assert any(t.columns > t.held for t in engine.trace)
    assert all(
        t.why in ("best", "explore", "probe", "follow", "start", "flush") for t in engine.trace
    )
    # A run of plain steps starts with its first pass queued (a step of no tokens) and ends
    # with its last read as it stops (its tokens dropped for rows that ended meanwhile);
    # those steps are traced too.
    starts = [t for t in plain if t.why == "start"]
    assert starts and all(t.tokens == 0 for t in starts)
    assert any(t.why == "flush" for t in plain)
    # Rows with a fixed k draft it whatever a step would cost: no step is priced.
    assert all(t.expected_seconds == t.expected_tokens == 0 for t in engine.trace)
    # Each finished row's pace: its tokens, drafts and time (`RowTrace`).
    rows = sorted(engine.row_trace, key=lambda r: r.tokens)
    assert [r.tokens for r in rows] == sorted(len(tokens) for tokens, _ in results)
    assert sorted((r.drafted, r.accepted) for r in rows) == sorted(
        (final.stats.drafted, final.stats.accepted) for _, final in results
    )
    assert all(r.seconds >= 0 and r.paced > 0 and r.accepted <= r.drafted for r in rows)


def test_the_trace_keeps_the_policys_price_of_each_step(loaded, tmp_path, capsys):
    """Each speculative step the policy chose by rate (a best, probing or exploring step) keeps
    the tokens and seconds the policy priced it at: tokens within what its rows could emit,
    a positive time; a follow step repeats its switch step's plan unpriced; plain steps have
    no price. `mlx-spec steps` lays them beside what the steps realised."""
    from mlx_spec.bench import step_timeline as timeline

    model, tok, draft, _ = loaded["llama"]
    engine = engine_for(model, tok, {"draft-model": BatchDraftModel(draft)}, max_batch=4)
    path = tmp_path / "steps.jsonl"
    engine.trace = StepLog(path)
    run_all(engine, busy_requests(scored_vocab(model, tok), "draft-model", "auto"))
    steps = timeline.load(str(path))
    spec = [s for s in steps if s["num_draft"]]
    priced = [s for s in spec if s["expected_seconds"] > 0]
    assert priced and all(s["why"] in ("best", "probe", "explore", "closed") for s in priced)
    assert all(
        s["rows"] <= s["expected_tokens"] <= s["rows"] * (1 + s["num_draft"]) for s in priced
    )
    assert all(
        s["expected_seconds"] == s["expected_tokens"] == 0 for s in spec if s["why"] == "follow"
    )
    assert all(s["expected_seconds"] == 0 for s in steps if not s["num_draft"])
    table = timeline.calibration(steps)
    assert sum(int(line.split("|")[4]) for line in table[2:]) == len(priced)
    if len(table) == 3:  # one kind: its row holds the means
        cells = [float(c) for c in table[2].split("|")[5].split("/")]
        expected = sum(s["expected_tokens"] for s in priced) / len(priced)
        realised = sum(s["tokens"] for s in priced) / len(priced)
        assert cells == pytest.approx([expected, realised], abs=0.05)
    capsys.readouterr()
    assert timeline.main([str(path)]) == 0
    assert "tokens a step: expected / realised" in capsys.readouterr().out
    # With the load runs marked (`server_load.py --trace-steps`): per mode and N.
    middle = priced[len(priced) // 2]["wall"]
    marks = [
        {"mode": "draft-model", "n": 4, "repeat": 1, "start": 0.0, "end": middle},
        {"mode": "draft-model", "n": 2, "repeat": 1, "start": middle + 1e-6, "end": 2e10},
    ]
    table = timeline.calibration(steps, marks)
    assert table[0].startswith("| mode | N | reason")
    runs = {line.split("|")[2].strip() for line in table[2:]}
    assert "4" in runs and runs <= {"4", "2"}
    assert sum(int(line.split("|")[6]) for line in table[2:]) == len(priced)


def test_step_log_writes_each_step_as_it_runs(loaded, tmp_path):
    """`StepLog` (`serve --trace-steps`): the engine writes each step as a JSON line while it
    runs, as it would append it to its trace list: the same fields, the drafters a speculative
    step's rows drafted with (none for a plain one) and a time that never goes back; the
    same tokens as without it. `mlx-spec steps` reads it back."""
    model, tok, draft, _ = loaded["llama"]
    vocab = scored_vocab(model, tok)
    requests = busy_requests(vocab, "all", 3, n=4) + busy_requests(vocab, None, 0, n=2)
    path = tmp_path / "steps.jsonl"
    drafters = {"ngram": BatchNgram(), "draft-model": BatchDraftModel(draft)}
    engine = engine_for(model, tok, drafters, max_batch=3)
    engine.trace = StepLog(path)
    first = run_all(engine, requests)
    lines = path.read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    assert len(steps) > 4 and all(line.endswith("}") for line in lines)
    fields = set(StepTrace.__dataclass_fields__) | {"t", "wall"}
    assert all(set(step) == fields for step in steps)
    assert all(abs(step["wall"] - time.time()) < 600 for step in steps)  # the clock's time
    times = [step["t"] for step in steps]
    assert times == sorted(times) and times[0] >= 0
    spec = [step for step in steps if step["num_draft"]]
    used = [set(step["drafters"].split("+")) for step in spec]
    assert spec and all(names and names <= {"ngram", "draft-model"} for names in used)
    assert all(step["drafters"] == "" for step in steps if not step["num_draft"])
    drafters = {"ngram": BatchNgram(), "draft-model": BatchDraftModel(draft)}
    engine = engine_for(model, tok, drafters, max_batch=3)
    assert [tokens for tokens, _ in run_all(engine, requests)] == [t for t, _ in first]
    from mlx_spec.bench import step_timeline as timeline

    read = timeline.load(str(path))
    assert [step["tokens"] for step in read] == [step["tokens"] for step in steps]
    assert all(step["ms"] > 0 and step["gap_ms"] >= 0 for step in read)
    table = timeline.by_kind(read)
    assert sum(int(line.split("|")[5]) for line in table[2:]) == len(steps)
    assert timeline.main([str(path), "--bins", "0.05"]) == 0
    # Marks of the load runs (`server_load.py --trace-steps`): a table per mode and N, each
    # run's steps those whose clock time falls in it.
    middle = steps[len(steps) // 2]["wall"]
    marks = [
        {"mode": "all", "n": 3, "repeat": 1, "start": steps[0]["wall"] - 1, "end": middle},
        {"mode": "all", "n": 3, "repeat": 2, "start": middle + 1e-6, "end": time.time()},
    ]
    table = timeline.by_run(read, marks)
    assert len(table) == 3 and table[2].startswith("| all | 3 | 2 |")
    assert float(table[2].rsplit("|", 2)[1]) > 0  # tokens per second
    (tmp_path / "steps.jsonl.marks.jsonl").write_text("\n".join(map(json.dumps, marks)))
    assert timeline.main([str(path)]) == 0
    from mlx_spec.cli import main as cli

    assert cli(["steps", str(path), "--top", "3"]) == 0  # `mlx-spec steps`
    assert cli(["steps", str(tmp_path / "missing.jsonl")]) == 2
    assert timeline.main([str(tmp_path / "missing.jsonl")]) == 2


@pytest.mark.parametrize("num_draft", ["auto", 2])
def test_greedy_rows_equal_single_stream_mtp(mtp_target, num_draft):
    """The MTP head batched (and grouped with n-gram lookup), rows joining and leaving."""
    model, tok, head = mtp_target
    for drafter in ("mtp", "all"):
        drafters = {"ngram": BatchNgram(), "mtp": BatchMTP(head.module)}
        engine = engine_for(model, tok, drafters, max_batch=3, prefill_step=16)
        requests = busy_requests(hfm.VOCAB, drafter, num_draft, n=5)
        for req, (tokens, _) in zip(requests, run_all(engine, requests), strict=True):
            plain = mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"])
            assert tokens == plain.tokens, (drafter, req["prompt"])


def random_requests(seed: int, sizes: list[tuple[int, int]], **fields) -> list[dict]:
    """Greedy requests of random prompts, a BOS then p ids, each for m tokens ((p, m) in
    `sizes`), with `fields` (the drafter, its k)."""
    rng = random.Random(seed)
    return [
        dict(
            prompt=[1] + [rng.randrange(3, hfm.VOCAB) for _ in range(p)],
            sampling=SamplingConfig(),
            max_tokens=m,
            **fields,
        )
        for p, m in sizes
    ]


def three_clients(engine: BatchEngine, model, tok, requests: list[dict]) -> list[list[int]]:
    """Five requests from three clients, the last two each sent as one ends (they refill a
    batch of 3); each request's tokens are checked against single-stream decoding's and
    returned."""
    outputs, later = [[] for _ in requests], [3, 4]

    def add(i):
        def emit(item):
            if item.token is not None:
                outputs[i].append(item.token)
            elif later:
                add(later.pop(0))

        engine.add(BatchRequest(emit=emit, **requests[i]))

    for i in range(3):
        add(i)
    while engine.busy:
        engine.step()
    for req, tokens in zip(requests, outputs, strict=True):
        plain = mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"])
        assert tokens == plain.tokens, req["prompt"]
    return outputs


def no_plan_when_closed(engine: BatchEngine, seen: list | None = None) -> None:
    """The policy finds no plan wherever the batch is closed (elsewhere its own choice, or
    the one a test set before); `seen` gets whether each choice was a closed batch's."""
    drafting = engine.policy.choose

    def choose(asks):
        if seen is not None:
            seen.append(engine.policy.closed)
        if engine.policy.closed:
            return BatchChoice(0, [(None, 0)] * len(asks), why="closed")
        return drafting(asks)

    engine.policy.choose = engine.policy.replan = lambda asks, *_: choose(asks)


@pytest.mark.parametrize("num_draft", ["auto", 2])
def test_a_closed_batch_that_finds_no_plan_sheds_its_model_drafters(mtp_target, num_draft):
    """Where a closed batch finds no plan every row gains by, twice running (a hold of
    plain steps between), its rows leave their model drafters (the MTP head) for the rest
    of their requests and decode with the lookup alone,
    each request's tokens still those of single-stream decoding; the head's state of each
    row goes to the prompt cache with its sequence, and a request that refills the batch
    while it keeps finding no plan does not join the head. Rows with a fixed k keep theirs."""
    model, tok, head = mtp_target
    drafters = {"ngram": BatchNgram(), "mtp": BatchMTP(head.module)}
    cache = RowCache()
    engine = engine_for(model, tok, drafters, max_batch=3, prefill_step=16, row_cache=cache)
    mtp = engine.names.index("mtp")
    always_draft(engine, mtp)
    no_plan_when_closed(engine)
    engine.policy.join_pays = lambda *args, **kwargs: True  # each row asked joins the head
    closed, joined, plain_step, take_in = [], [], engine._plain_step, engine._take_in

    def recorded(rows, choice):
        plain_step(rows, choice)
        if choice.why == "closed":
            held = {r.id for r in rows} & set(drafters["mtp"].rows)
            model = [a for r in rows for a in r.arms + r.skipped if a == mtp]
            closed.append(not held and not model)

    def taken(row, arm, *args):
        if arm == mtp:
            joined.append(row.request.prompt)
        take_in(row, arm, *args)

    engine._plain_step, engine._take_in = recorded, taken
    sizes = [(5, 60), (12, 70), (9, 80), (20, 20), (8, 15)]  # three long, two refilling
    requests = random_requests(5, sizes, drafter="all", num_draft=num_draft)
    outputs = three_clients(engine, model, tok, requests)
    first = [req["prompt"] for req in requests[:3]]
    assert all(prompt in joined for prompt in first)
    entry = cache.take(first[0] + outputs[0], ["mtp"], engine.features.of(["mtp"]))
    if num_draft == "auto":  # shed after the first hold, for good
        hold = engine.policy.closed_hold
        assert not any(closed[:hold]) and closed[hold:] and all(closed[hold:])
        assert entry.states.get("mtp") is not None
        assert all(req["prompt"] not in joined for req in requests[3:])
    else:  # fixed k: no closed hold, no shedding
        assert not any(closed)
        assert all(req["prompt"] in joined for req in requests[3:])
    assert engine.cache is None and all(not d.rows for d in drafters.values())


def test_a_closed_batch_that_keeps_finding_no_plan_asks_ever_less_often(loaded):
    """A closed batch that finds no plan holds its rows to plain steps for `closed_hold`
    steps before they ask again; as its steps without a plan mount, the hold grows (half of
    them), up to `HOLD_GROWTH` holds, and it never shrinks while the batch keeps finding
    none; rows that join a batch that sheds wait out its hold (else they ask at once:
    `test_rows_that_refill_a_shedding_batch_wait_out_its_hold`). Each request's tokens are
    single-stream decoding's."""
    model, tok, _, _ = loaded["llama"]
    tok = with_eos(tok)
    engine = engine_for(model, tok, {"ngram": BatchNgram()}, max_batch=3, prefill_step=16)
    engine.policy.closed_hold = hold = 4  # (holds of a few steps: short requests show them)
    asked = []
    no_plan_when_closed(engine, asked)
    calls, closed_choice = [], engine._closed_choice

    def recorded(rows, ids, free):
        before, shedding = len(asked), engine._shedding
        choice = closed_choice(rows, ids, free)
        calls.append((tuple(ids), len(asked) > before and asked[-1], choice.why, shedding))
        return choice

    engine._closed_choice = recorded
    rng, vocab = random.Random(11), scored_vocab(model, tok)
    requests = [
        dict(
            prompt=[1] + [rng.randrange(3, vocab) for _ in range(p)],
            sampling=SamplingConfig(),
            max_tokens=m,
            drafter="ngram",
        )
        for p, m in [(6, 90), (9, 100), (4, 110), (7, 40), (5, 30)]
    ]
    three_clients(engine, model, tok, requests)  # (each checked against single-stream)
    runs, last = [], None  # the gaps between the asks of each set of rows in a closed batch
    for i, (ids, closed_ask, why, shedding) in enumerate(calls):
        if why == "closed" and not closed_ask:  # held: the rows that asked last, or new
            assert last is not None and (ids == calls[last][0] or shedding), (i, calls[last])
        if closed_ask:
            if last is not None and calls[last][0] == ids:
                runs[-1].append(i - last)
            else:
                runs.append([])
            last = i
    gaps = [gap for run in runs for gap in run]
    assert gaps[:2] == [hold, hold], gaps
    assert max(gaps) == HOLD_GROWTH * hold, gaps
    assert all(a <= b for run in runs for a, b in zip(run, run[1:], strict=False)), runs
    assert len(runs) >= 3  # the rows that joined asked, and were held again


@pytest.mark.parametrize("hold,waits", [(4, True), (60, False)])
def test_rows_that_refill_a_shedding_batch_wait_out_its_hold(loaded, hold, waits):
    """Three equal requests end on one step of a closed batch that finds no plan, and the
    next two refill it together. Where the batch sheds by then (it has gone more than a
    `closed_hold` without a plan), they decode plainly for what is left of its hold before
    they ask; where it does not, they ask at once. Each request's tokens are single-stream
    decoding's."""
    model, tok, _, _ = loaded["llama"]
    tok = with_eos(tok)  # (no EOS: each request runs to its max_tokens)
    engine = engine_for(model, tok, {"ngram": BatchNgram()}, max_batch=3, prefill_step=16)
    engine.policy.closed_hold = hold
    no_plan_when_closed(engine)
    calls, closed_choice, ask = [], engine._closed_choice, engine._ask
    engine._ask = lambda row: (calls.append(("ask", row.id)), ask(row))[1]

    def recorded(rows, ids, free):
        calls.append(("step", tuple(ids), engine._shedding))
        return closed_choice(rows, ids, free)

    engine._closed_choice = recorded
    sizes = [(6, 36), (6, 36), (6, 36), (5, 30), (7, 30)]
    requests = random_requests(3, sizes, drafter="ngram")
    three_clients(engine, model, tok, requests)  # (each checked against single-stream)
    steps = [i for i, call in enumerate(calls) if call[0] == "step"]
    first = steps[0]
    refill = next(i for i in steps if calls[i][1] != calls[first][1])
    assert len(calls[refill][1]) == 2 and not set(calls[refill][1]) & set(calls[first][1])
    assert calls[refill][2] == waits  # the batch sheds by then, or not
    asked = [i for i in steps if i + 1 < len(calls) and calls[i + 1][0] == "ask"]
    later = [i for i in asked if i >= refill]
    if waits:  # held: the new rows' first ask comes within what is left of the hold
        assert later[0] > refill
        assert steps.index(later[0]) - steps.index(refill) <= HOLD_GROWTH * hold
    else:
        assert later[0] == refill


def test_plain_steps_tell_the_drafters_at_the_rows_next_ask(mtp_target):
    """A plain step keeps each row's token (and its features) from the row's drafters until
    something reads their state of it: at each ask they hold its whole sequence, told in one
    `accept` of the plain steps since (a closed batch's hold), with one feature row per
    token; each request's tokens are single-stream decoding's."""
    model, tok, head = mtp_target
    drafters = {"ngram": BatchNgram(), "mtp": BatchMTP(head.module)}
    engine = engine_for(model, tok, drafters, max_batch=3, prefill_step=16, row_cache=RowCache())
    engine.policy.closed_hold = 4
    engine.policy.join_pays = lambda *args, **kwargs: True
    engine._shed = lambda rows: None  # (the rows keep the head, which is told too)
    always_draft(engine, engine.names.index("mtp"))
    drafting, rounds = engine.policy.choose, []

    def choose(asks):  # two choices of no plan (held in a closed batch), then a draft
        rounds.append(len(asks))
        if len(rounds) % 3:
            return BatchChoice(0, [(None, 0)] * len(asks), why="closed")
        return drafting(asks)

    engine.policy.choose = engine.policy.replan = lambda asks, *_: choose(asks)
    told = []
    for name, drafter in drafters.items():

        def accept(row, drafted, accepted, emitted, hidden, name=name, real=drafter.accept):
            assert hidden is None or hidden.shape[0] == len(emitted)
            told.append((name, drafted, len(emitted)))
            real(row, drafted, accepted, emitted, hidden)

        drafter.accept = accept
    ask, asked = engine._ask, []

    def checked(row):
        out = ask(row)
        assert drafters["ngram"]._history[row.id].history == row.tokens
        if row.id in drafters["mtp"].rows:
            assert drafters["mtp"]._pending[row.id][-1] == row.tokens[-1]
        asked.append(row.id)
        return out

    engine._ask = checked
    requests = random_requests(8, [(5, 50), (12, 60), (9, 40), (7, 30), (8, 25)], drafter="all")
    three_clients(engine, model, tok, requests)
    assert len(set(asked)) == len(requests)
    held = [n for name, drafted, n in told if name == "mtp" and not drafted]
    assert max(held) >= engine.policy.closed_hold  # a hold's plain steps, told at once
    assert any(drafted for _, drafted, _ in told)  # and drafts between
    # The features each row kept through its plain steps (rows told together take theirs
    # out of one stack of the steps' features) are the target's at each of its positions.
    assert len(engine.row_cache) == len(requests)
    for item in engine.row_cache:
        assert item.hidden.shape[0] == len(item.tokens) - 1
        want = ModelRunner(model, hfm.VOCAB, keep_hidden=True).prefill(item.tokens[:-1])
        assert mx.allclose(item.hidden, want, atol=1e-4).item()


def test_rows_ending_together_take_their_features_from_one_stack(mtp_target):
    """Three equal requests of the MTP head in a closed batch that finds no plan end on one
    step: their drafters are told their plain steps as they leave, their features taken out
    of one stack of the steps' features (the prompt cache's entries hold the target's), and
    the engine, idle, holds no stack."""
    model, tok, head = mtp_target
    drafters = {"mtp": BatchMTP(head.module)}
    engine = engine_for(model, tok, drafters, max_batch=3, row_cache=RowCache())
    no_plan_when_closed(engine)
    stacks, stacked = [], engine._untold_hidden
    engine._untold_hidden = lambda parts: (stacks.append(len(parts)), stacked(parts))[1]
    requests = random_requests(4, [(6, 20), (9, 20), (7, 20)], drafter="mtp")
    results = run_all(engine, requests)
    for req, (tokens, _) in zip(requests, results, strict=True):
        assert tokens == mlx_spec.generate(model, tok, req["prompt"], max_tokens=20).tokens
    assert max(stacks) > 1 and engine._stacked is None
    for item in engine.row_cache:
        want = ModelRunner(model, hfm.VOCAB, keep_hidden=True).prefill(item.tokens[:-1])
        assert mx.allclose(item.hidden, want, atol=1e-4).item()


def direct_join_run(model, tok, drafters, drafter, vocab):
    """Three prompts run once (their entries fill the prompt cache), then asked again among
    three fresh ones in a busy batch: returns the second run's results, its requests and the
    ids of the rows its prefill passes fed."""
    engine = engine_for(model, tok, drafters, max_batch=3, prefill_step=16, row_cache=RowCache())
    requests = busy_requests(vocab, drafter, 2, n=6)  # a fixed k: drafts whatever the timing
    run_all(engine, requests[:3])
    prefilled = set()
    real = engine._prefill_group
    engine._prefill_group = lambda group: (prefilled.update(r.id for r in group.rows), real(group))
    again = [requests[3], requests[0], requests[4], requests[1], requests[2], requests[5]]
    first_id = engine._next_id
    results = run_all(engine, again)
    return results, again, {i - first_id for i in prefilled}


@pytest.mark.parametrize(
    "drafter,step,slack,spare,least",
    [("draft-model", "_speculative_step", 0.25, 16, 20), (None, "_plain_step", 0.1, 8, 40)],
)
def test_steps_keep_the_cache_narrow(loaded, drafter, step, slack, spare, least):
    """Rows of different lengths join and leave around each other (the outputs are those of
    plain decoding). Speculative steps: rows accept drafts by their own amounts and each
    writes after its own end, so the rejected drafts' columns are reused; columns left of a
    row (a shorter row that joined, a longer one that left) are compacted once they pass a
    quarter of what the longest row holds. Plain steps: after rows leave, the columns are
    squeezed once they pass a tenth of it and 8 (they were left to reach twice it before:
    every pass, and every row that joined, paid for the rest)."""
    model, tok, draft, _ = loaded["llama"]
    tok = with_eos(tok)
    engine = engine_for(model, tok, {"draft-model": BatchDraftModel(draft)}, max_batch=4)
    requests = busy_requests(scored_vocab(model, tok), drafter, 4 if drafter else 0)
    widths = widths_after(engine, step)
    results = run_all(engine, requests)
    for req, (tokens, _) in zip(requests, results, strict=True):
        assert (
            tokens
            == mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"]).tokens
        )
    assert len(widths) > least
    assert all(idx <= (1 + slack) * longest + spare for idx, longest in widths), widths


@pytest.mark.parametrize("drafter", [None, "draft-model"])
def test_requests_that_join_as_others_leave_take_their_rows(loaded, monkeypatch, drafter):
    """Requests waiting while rows end take the rows that ended (`BatchCache.place`): the
    batch's cache is not copied to drop a row and copied again to add one. Seven requests
    through three rows: only the last rows' leaving, with no request left to take their
    place, shrinks it. Every request's tokens are those of plain single-stream decoding."""
    model, tok, draft, _ = loaded["llama"]
    tok = with_eos(tok)
    engine = engine_for(model, tok, {"draft-model": BatchDraftModel(draft)}, max_batch=3)
    calls = collections.Counter()
    for name in ("filter", "extend", "place"):
        real = getattr(BatchCache, name)

        def counted(self, *args, real=real, name=name):
            if self is engine.cache:
                calls[name] += 1
            return real(self, *args)

        monkeypatch.setattr(BatchCache, name, counted)
    requests = busy_requests(scored_vocab(model, tok), drafter, "auto")
    results = run_all(engine, requests)
    for req, (tokens, _) in zip(requests, results, strict=True):
        want = mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"])
        assert tokens == want.tokens
    assert calls["place"] >= 3 and calls["filter"] <= 2 and calls["extend"] == 0, calls


@pytest.mark.parametrize("drafter", [None, "ngram", "draft-model", "mtp"])
def test_a_prompt_the_cache_holds_joins_the_batch_at_once(loaded, mtp_target, drafter):
    """A request whose prompt the prompt cache holds all but the last token of joins the
    running batch without a prefill pass (its last token is fed by the batch's next step, which
    draws its first token), and answers as from scratch; so do the rows around it."""
    if drafter == "mtp":
        model, tok, head = mtp_target
        drafters = {"mtp": BatchMTP(head.module)}
    else:
        model, tok, draft, _ = loaded["llama"]
        tok = with_eos(tok)
        drafters = {"ngram": BatchNgram(), "draft-model": BatchDraftModel(draft)}
    vocab = scored_vocab(model, tok)
    results, requests, prefilled = direct_join_run(model, tok, drafters, drafter, vocab)
    for req, (tokens, final) in zip(requests, results, strict=True):
        plain = mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"])
        assert tokens == plain.tokens, req["prompt"]
        assert final.stats.prefill_seconds > 0
    assert prefilled == {0, 2, 5}  # the fresh prompts only
    for i in (1, 3, 4):  # the prompts asked again
        assert results[i][1].stats.cached_tokens == len(requests[i]["prompt"]) - 1
    if drafter is not None:
        assert sum(final.stats.drafted for _, final in results) > 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_narrowed_heads_give_the_logits_at_the_positions_asked(loaded, mtp_target, family):
    """A batched drafter's catch-up projects its head at one position per row: a draft
    model's head narrowed from outside (an lm_head, or gemma3's tied embedding) and the MTP
    head's own `at` give the full pass's logits there (and the MTP head's fed-back state
    there), and the draft model is itself again afterwards."""
    from mlx_spec.caches.taps import head_positions

    draft = loaded[family][2]
    x = mx.array([[3, 4, 5, 6], [7, 8, 9, 10]], mx.uint32)
    at = mx.array([2, 0], mx.int32)
    want = mx.take_along_axis(draft(x), at[:, None, None], axis=1)
    got = head_positions(draft)(draft, at, x)
    assert got.shape == want.shape and mx.allclose(got, want, atol=1e-5)
    assert draft(x).shape == (2, 4, want.shape[-1])  # no position set: every one again
    head = mtp_target[2].module
    hidden = mx.random.normal((2, 4, head.layers[0].input_layernorm.weight.shape[0]))
    full = head(x, head.make_cache(), hidden)
    feedback = head.feedback
    got = head(x, head.make_cache(), hidden, at=at)
    assert mx.allclose(got, mx.take_along_axis(full, at[:, None, None], axis=1), atol=1e-5)
    assert mx.allclose(head.feedback, mx.take_along_axis(feedback, at[:, None, None], axis=1))


@pytest.mark.parametrize("tap_first", [True, False])
def test_a_narrowed_head_still_records_every_position(checkpoints, tap_first):
    """The engine narrows the target's head to each prefilled row's last position (no other
    position's logits are read); a recording tap on the same head (the features an MTP head
    reads) still holds every position, whichever of the two wrappers the head took first."""
    from mlx_spec.caches.taps import head_positions, tap_hidden

    model, _ = mlx_spec.load(str(checkpoints["llama"][0]))  # a fresh head, wrapped here only
    for wrap in (tap_hidden, head_positions) if tap_first else (head_positions, tap_hidden):
        wrap(model)
    tap = tap_hidden(model)
    x = mx.array([[3, 4, 5, 6], [7, 8, 9, 10]], mx.uint32)
    at = mx.array([3, 1], mx.int32)
    full = model(x)
    everything = tap.hidden
    got = head_positions(model)(model, at, x)
    assert got.shape == (2, 1, full.shape[-1])
    assert mx.allclose(got, mx.take_along_axis(full, at[:, None, None], axis=1), atol=1e-5)
    assert tap.hidden.shape == everything.shape == (2, 4, everything.shape[-1])
    assert mx.allclose(tap.hidden, everything, atol=1e-6)


def test_mtp_rows_take_entries_with_hidden_states(mtp_target):
    """A row drafting with the MTP head (it reads the target's hidden states) never takes an
    entry left by a plain row (none kept): it prefills anew, and its own entry then serves the
    next MTP turn, which answers as from scratch."""
    model, tok, head = mtp_target
    engine = engine_for(model, tok, {"mtp": BatchMTP(head.module)}, row_cache=RowCache())
    first = [1, 4, 5, 6, 7, 8, 9, 10, 11]
    plain = dict(sampling=SamplingConfig(), max_tokens=10, num_draft=0)
    ((reply, _),) = run_all(engine, [dict(plain, prompt=first)])
    second = first + reply + [12, 13]
    mtp = dict(plain, drafter="mtp", num_draft="auto")
    ((reply2, final),) = run_all(engine, [dict(mtp, prompt=second)])
    assert final.stats.cached_tokens == 0
    third = second + reply2 + [14]
    ((tokens, final),) = run_all(engine, [dict(mtp, prompt=third)])
    assert final.stats.cached_tokens == len(second) + len(reply2) - 1
    assert tokens == mlx_spec.generate(model, tok, third, max_tokens=10).tokens


def test_eos_and_stop_inside_a_batch(loaded):
    """EOS accepted inside a round and a stop string end their rows exactly where the
    single-stream path ends them; the other rows go on."""
    model, tok, draft, _ = loaded["llama"]
    plain = mlx_spec.generate(model, with_eos(tok), [1, 5, 6, 7], max_tokens=30).tokens
    eos = plain[9]
    tok_eos = with_eos(tok, [eos])
    text = mlx_spec.generate(model, with_eos(tok), [1, 5, 6, 7], max_tokens=30).text
    stop = text[12:14]
    drafters = {"ngram": BatchNgram(), "draft-model": BatchDraftModel(draft)}
    engine = engine_for(model, tok_eos, drafters, max_batch=4)
    base = dict(prompt=[1, 5, 6, 7], sampling=SamplingConfig(), max_tokens=30, num_draft=4)
    requests = [
        dict(base, drafter="draft-model"),
        dict(base, drafter="ngram", stop=(stop,)),
        dict(base, prompt=[1, 8, 9], drafter="draft-model"),
    ]
    results = run_all(engine, requests)
    for req, (tokens, final) in zip(requests, results, strict=True):
        want = mlx_spec.generate(
            model, tok_eos, req["prompt"], max_tokens=30, stop=req.get("stop", ())
        )
        assert tokens == want.tokens and final.finish_reason == want.finish_reason


def test_conversation_reuses_the_row_cache(loaded):
    """A second turn (first prompt + reply + new text) takes the first turn's caches from the
    prompt cache, prefills only its new tokens and answers as from scratch."""
    model, tok, draft, _ = loaded["gemma3"]
    tok = with_eos(tok)
    drafters = {"ngram": BatchNgram(), "draft-model": BatchDraftModel(draft)}
    engine = engine_for(model, tok, drafters, row_cache=RowCache())
    first = [1, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    base = dict(sampling=SamplingConfig(), max_tokens=20, drafter="draft-model")
    ((reply, _),) = run_all(engine, [dict(base, prompt=first)])
    second = first + reply + [13, 14, 15]
    ((tokens, final),) = run_all(engine, [dict(base, prompt=second)])
    assert tokens == mlx_spec.generate(model, tok, second, max_tokens=20).tokens
    assert final.stats.cached_tokens == len(first) + len(reply) - 1
    assert engine.row_cache.counts["hits"] == 1


def test_copied_cache_is_independent(loaded):
    """A copy fed, cut back and compacted leaves the original as it was: both go on to give the
    logits of a fresh pass over their own sequences (gemma3: past its sliding window)."""
    model = loaded["gemma3"][0]
    seq = list(range(3, 15))
    one = BatchCache(model, 1)
    one.begin([len(seq)])
    model(mx.array([seq]), cache=one.layers)
    one.end([len(seq)])
    before = [mx.array(a) for a in one.state]
    twin = one.copy()
    twin.truncate([5])
    twin.compact()
    twin.begin([3])
    got = model(mx.array([[20, 21, 22]]), cache=twin.layers)[0]
    twin.end([3])
    assert mx.allclose(got, single_logits(model, seq[:5] + [20, 21, 22])[-3:], atol=1e-4).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, one.state, strict=True))
    one.begin([2])
    got = model(mx.array([[16, 17]]), cache=one.layers)[0]
    one.end([2])
    assert mx.allclose(got, single_logits(model, seq + [16, 17])[-2:], atol=1e-4).item()


def test_shared_prefixes_keep_their_entry(loaded):
    """The same prompt asked again, and a prompt sharing its start, each copy what they share
    from the first request's entry, which stays for the next one; a turn that continues a whole
    entry takes it; every answer equals decoding from scratch."""
    model, tok, draft, _ = loaded["gemma3"]
    tok = with_eos(tok)
    drafters = {"ngram": BatchNgram(), "draft-model": BatchDraftModel(draft)}
    engine = engine_for(model, tok, drafters, row_cache=RowCache())
    first = [1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    base = dict(sampling=SamplingConfig(), max_tokens=12, drafter="draft-model")
    ((reply, _),) = run_all(engine, [dict(base, prompt=first)])
    prompts = [first[:8] + [15, 16], first, first, first + reply + [17, 18]]
    cached = [8, len(first) - 1, len(first) - 1, len(first) + len(reply) - 1]
    for prompt, want in zip(prompts, cached, strict=True):
        ((tokens, final),) = run_all(engine, [dict(base, prompt=prompt)])
        assert tokens == mlx_spec.generate(model, tok, prompt, max_tokens=12).tokens
        assert final.stats.cached_tokens == want, prompt
    counts = engine.row_cache.counts
    assert counts["hits"] == 4 and counts["misses"] == 1
    # The entries of the repeated prompt were continued by the last turn's, which replaced them.
    assert sorted(len(item.tokens) for item in engine.row_cache) == [
        10 + 12,
        len(prompts[-1]) + 12,
    ]


def test_cancelled_row_leaves_at_once(loaded):
    model, tok, draft, _ = loaded["llama"]
    engine = engine_for(model, with_eos(tok), {"draft-model": BatchDraftModel(draft)})
    seen = []
    rows = [
        engine.add(
            BatchRequest([1, 4, 5], SamplingConfig(), 50, seen.append, drafter="draft-model")
        )
        for _ in range(2)
    ]
    for _ in range(3):
        engine.step()
    engine.cancel(rows[0])
    engine.step()
    assert engine.cache.batch == 1 and engine.drafters["draft-model"].rows == [rows[1].id]


def test_requests_wait_for_cache_memory(loaded):
    """Under `max_kv_bytes` room for one request's prompt + max_tokens, three requests run one
    after another (each equal to its single-stream output); one that alone needs more than the
    budget fails with a clear error and the engine goes on."""
    model, tok = loaded["llama"][:2]
    tok = with_eos(tok)
    engine = engine_for(model, tok, {})
    engine.max_kv_bytes = int(1.5 * engine.token_bytes[None] * (4 + 30))
    requests = [
        dict(prompt=[1, 5, 6, n], sampling=SamplingConfig(), max_tokens=30) for n in (7, 8, 9)
    ]
    peak = 0
    original = engine._decode

    def watched():
        nonlocal peak
        peak = max(peak, len(engine.active))
        original()

    engine._decode = watched
    for req, (tokens, _) in zip(requests, run_all(engine, requests), strict=True):
        assert tokens == mlx_spec.generate(model, tok, req["prompt"], max_tokens=30).tokens
    assert peak == 1
    errors = []
    engine.add(BatchRequest([1, 5, 6], SamplingConfig(), 200, errors.append))
    while engine.busy:
        engine.step()
    assert (
        len(errors) == 1 and isinstance(errors[0], ValueError) and "MiB of cache" in str(errors[0])
    )


# ------------------------------------------------------------------------------ distribution


def batch_samples(models, config, busy: bool) -> list:
    """The first three tokens of RUNS rows sampled with k = 2 in batches of 64 (each row its own
    random stream), some batches shared with rows of other prompts and settings."""
    model, tok, draft, _ = models
    engine = engine_for(
        model, tok, {"draft-model": BatchDraftModel(draft)}, max_batch=64, prefill_step=4096
    )
    sampling = dict(
        sampling=config, max_tokens=DISTRIBUTION_LENGTH, drafter="draft-model", num_draft=2
    )
    requests = [dict(sampling, prompt=DISTRIBUTION_PROMPT, seed=seed) for seed in range(RUNS)]
    if busy:  # a greedy row and a hotter row with another prompt after every fifth
        others = [
            dict(prompt=[3, 5], sampling=SamplingConfig(), max_tokens=6, drafter="draft-model"),
            dict(prompt=[4], sampling=SamplingConfig(temperature=1.3), max_tokens=5, num_draft=0),
        ]
        requests = [
            r for i, req in enumerate(requests) for r in ([req] + (others if i % 5 == 0 else []))
        ]
    results = run_all(engine, requests)
    return [
        tuple(tokens)
        for req, (tokens, _) in zip(requests, results, strict=True)
        if req["prompt"] == DISTRIBUTION_PROMPT
    ]


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1]], ids=["t1-top_k3", "t0.7-top_p0.8"])
def test_batched_rows_keep_the_distribution(pair, config):
    """Chi-square of 2000 rows sampled inside busy batches against the exact distribution."""
    samples = batch_samples(pair, config, busy=True)
    assert len(samples) == RUNS
    assert chisquare_pvalue(samples, exact_distribution(pair[0], config)) > ALPHA


def _recover_from_target(target_probs, draft_probs):
    return target_probs


@pytest.mark.parametrize("control", ["gross", "subtle"])
def test_batched_negative_controls_fail(pair, monkeypatch, control):
    """The same test rejects a batch verifier that accepts every draft and one that draws the
    recovered token from the target's distribution instead of the residual."""
    if control == "gross":
        original = mlx_spec.core.batch_verify.batch_verify

        def always(target_probs, draft_probs, draft_tokens, num_drafted, uniforms, noise):
            return original(
                target_probs, draft_probs, draft_tokens, num_drafted, uniforms * 0 - 1e9, noise
            )

        monkeypatch.setattr("mlx_spec.decoding.speculative_step.batch_verify", always)
    else:
        monkeypatch.setattr(mlx_spec.core.batch_verify, "residual", _recover_from_target)
    samples = batch_samples(pair, CONFIGS[0], busy=False)
    assert chisquare_pvalue(samples, exact_distribution(pair[0], CONFIGS[0])) < ALPHA


@pytest.mark.parametrize("drafter", ["draft-model", "ngram"])
def test_seeded_row_is_the_same_alone_and_in_a_busy_batch(pair, drafter):
    """A seeded row with a fixed k draws from its own stream: the same tokens alone and beside
    rows that start, draft and finish around it (n-gram: also when its lookup finds nothing
    and it takes plain steps)."""
    model, tok, draft, _ = pair
    config = SamplingConfig(temperature=1.0)
    req = dict(
        prompt=DISTRIBUTION_PROMPT,
        sampling=config,
        max_tokens=24,
        drafter=drafter,
        num_draft=2,
        seed=11,
    )

    def run(extra):
        drafters = {"draft-model": BatchDraftModel(draft), "ngram": BatchNgram()}
        engine = engine_for(model, tok, drafters, max_batch=8)
        return run_all(engine, [req] + extra)[0][0]

    others = [
        dict(req, seed=None, prompt=[3, 4], max_tokens=n, num_draft=("auto", 0, 1)[n % 3])
        for n in (5, 30, 12)
    ]
    assert run([]) == run(others)


def test_seeded_row_is_the_same_whether_its_prompt_was_cached(pair):
    """A seeded row with a fixed k gives the same tokens from a fresh prompt (prefilled, its
    first token drawn after the prefill) and from one the prompt cache holds (joining the
    batch at once, its first token drawn by the batch's next step)."""
    model, tok, draft, _ = pair
    req = dict(prompt=DISTRIBUTION_PROMPT, sampling=SamplingConfig(temperature=1.0),
               max_tokens=24, drafter="draft-model", num_draft=2, seed=5)  # fmt: skip
    engine = engine_for(
        model, tok, {"draft-model": BatchDraftModel(draft)}, max_batch=4, row_cache=RowCache()
    )
    ((fresh, _),) = run_all(engine, [req])
    other = dict(req, seed=None, prompt=[3, 4], max_tokens=9)
    (cached, final), _ = run_all(engine, [req, other])
    assert final.stats.cached_tokens == len(DISTRIBUTION_PROMPT) - 1
    assert cached == fresh


# ---------------------------------------------------------------------------------- policy


def outcomes_of(rows, rng: random.Random, accept: float) -> list[tuple[int, int]]:
    """(drafted, accepted) per row of a step's `rows` ((arm, k) each): each draft kept, in
    order, with probability `accept`."""
    out = []
    for _, k in rows:
        n = 0
        while n < k and rng.random() < accept:
            n += 1
        out.append((k, n))
    return out


def drive(
    policy: BatchDraftPolicy, rows: int, accept: float, token_cost: float, steps=300, cost=None
):
    """Feed the policy synthetic steps: each draft kept with probability `accept`; a step costs
    1 ms + `token_cost` ms per target token + 0.2 ms per draft pass, or `cost(width)`."""
    rng = random.Random(0)
    ks = []
    for _ in range(steps):
        asks = [RowAsk([0], None, 8, [None]) for _ in range(rows)]
        choice = policy.choose(asks)
        ks.append(choice.num_draft)
        outcomes = outcomes_of(choice.rows, rng, accept)
        width = 1 + max(k for _, k in choice.rows)
        seconds = 1e-3 * (1 + token_cost * rows * width + 0.2 * (width - 1))
        if cost is not None:
            seconds = cost(width)
        policy.observe(choice.rows, outcomes, seconds, window=choice.window)
    return ks


def test_batch_policy_follows_the_cost_of_verification():
    """Acceptance 0.8: with verification nearly free (memory-bound) the batch drafts several
    tokens a row; when each verified token costs as much as the step's fixed part
    (compute-bound, a large batch on a CPU) it decodes plainly, probing now and then."""
    cheap = drive(BatchDraftPolicy(["draft"]), rows=4, accept=0.8, token_cost=0.01)
    dear = drive(BatchDraftPolicy(["draft"]), rows=8, accept=0.8, token_cost=1.0)
    assert sum(k >= 2 for k in cheap[-100:]) >= 90
    assert sum(k == 0 for k in dear[-100:]) >= 90


def test_batch_policy_learns_a_width_that_costs_less_than_its_neighbours():
    """A CPU's matrix kernels can run a pass of width 2 for little more than a plain one and
    width 3 for far more (measured at B = 8 on a 2-core x86): the line through all widths
    would make K = 1 look too dear and K = 2 too cheap; the per-width costs find K = 1."""
    widths = {1: 20e-3, 2: 22e-3, 3: 32e-3, 4: 40e-3}

    def cost(width):
        return widths.get(width, 10e-3 * width) + 4e-3 * (width > 1)  # + drafting

    policy = BatchDraftPolicy(["draft"], guard=False)  # the policy's own choices
    ks = drive(policy, rows=8, accept=0.75, token_cost=0, cost=cost)
    assert sum(k == 1 for k in ks[-100:]) >= 80


def test_the_engine_tells_the_policy_when_its_batch_is_closed(loaded):
    """The engine marks a step's batch closed (`BatchDraftPolicy.closed`) only when every slot
    is taken and no request waits or joins: 5 requests in 3 slots wait at first (open), the
    last 3 running fill them with none behind (closed)."""
    model, tok, draft, _ = loaded["llama"]
    engine = engine_for(model, tok, {"ngram": BatchNgram()}, max_batch=3)
    seen, choose = [], engine.policy.choose

    def watched(asks):
        seen.append((len(asks), bool(engine.waiting), engine.policy.closed))
        return choose(asks)

    engine.policy.choose = watched
    requests = busy_requests(scored_vocab(model, tok), "ngram", "auto", n=5)
    run_all(engine, requests)
    assert all(closed == (rows == 3 and not waiting) for rows, waiting, closed in seen)
    assert any(closed for *_, closed in seen) and any(waiting for _, waiting, _ in seen)


def test_rows_without_a_drafter_decode_unasked(loaded):
    """Where no row of a step has a drafter (speculation off), the step is plain decoding
    without the rows' asks or the policy's weighing of them (a host's work per step); the
    policy still times the plain steps. Where one row has a drafter, the rows ask again."""
    model, tok, draft, _ = loaded["llama"]
    engine = engine_for(model, tok, {"ngram": BatchNgram()}, max_batch=3)
    asked, choose = [], engine.policy.choose

    def watched(asks):
        asked.append(len(asks))
        return choose(asks)

    engine.policy.choose = watched
    vocab = scored_vocab(model, tok)
    plain = run_all(engine, busy_requests(vocab, None, "auto", n=5))
    assert not asked and engine.policy._plain_seen >= 2
    alone = [run_all(engine_for(model, tok, {}, max_batch=1), [r])[0] for r in busy_requests(
        vocab, None, "auto", n=5)]  # fmt: skip
    assert [tokens for tokens, _ in plain] == [tokens for tokens, _ in alone]
    run_all(engine, busy_requests(vocab, "ngram", "auto", n=2))
    assert asked


def closed_batch(policy, accepts, cost, rng, budget=64, why=None, found=None):
    """Run one batch to its end: a row per acceptance in `accepts` (each of its drafts kept
    with that probability), each with `budget` tokens to emit, no row joining: closed while
    every row runs; a step of b rows verifying w tokens a row costs `cost(b, w)` seconds
    (policy None: plain decoding). Each row's seconds to its end; `why` collects the
    reasons of the closed steps' choices. `found`: a lookup's chance of a match at a step
    (3 drafts then, none else; None: a model drafter, drafts always to be had)."""
    rows = [[accept, RowRecord(), budget, i] for i, accept in enumerate(accepts)]
    seconds, ends = 0.0, [0.0] * len(accepts)
    while rows:
        choice = None
        if policy is not None:
            policy.closed = len(rows) == len(accepts)
            asks = []
            for _, r, left, _ in rows:
                available = None if found is None else 3 if rng.random() < found else 0
                asks.append(r.ask([0], None, min(8, left - 1), [available], [], left=left))
            choice = policy.choose(asks)
            if why is not None and policy.closed:
                why.append(choice.why if any(k for _, k in choice.rows) else "plain")
        plan = choice.rows if choice is not None else [(None, 0)] * len(rows)
        outcomes = []
        for row, (_, k) in zip(rows, plan, strict=True):
            kept = 0
            while kept < k and rng.random() < row[0]:
                kept += 1
            outcomes.append((k, kept))
            if k:
                row[1].drafted(0, k, kept)
            row[2] -= min(row[2], kept + 1)
        step = cost(len(rows), 1 + max(k for _, k in plan))
        seconds += step
        if choice is not None:
            policy.observe(plan, outcomes, step, window=choice.window)
        for row in rows:
            if row[2] <= 0:
                ends[row[3]] = seconds
        rows = [row for row in rows if row[2] > 0]
    return ends


def test_a_closed_batch_drafts_only_where_every_row_gains():
    """Every slot taken and nothing waiting (`closed`): the batch serves its own rows alone.
    Where a verifying pass costs a CPU's (8 rows verifying one draft a row 1.33x a plain
    step), choosing K by rate sped the rows that keep their drafts and slowed those that
    do not (they pay the wider pass): the slowest ended well after plain decoding would have
    ended it. Drafting only where every row is expected to gain, no row ends later than
    plain decoding by more than a step or two, and a closed batch runs no probe and no
    exploring step. Where a wider pass costs little more (memory-bound), every row gains
    and the batch keeps speculation's gain."""

    def cpu(rows, width):  # a plain step of 8 rows 15.6 ms, one draft a row 20.8 (1.33x)
        return 8.3e-3 + rows * (0.9e-3 + 0.65e-3 * (width - 1))

    def gpu(rows, width):
        return 5e-3 + 0.3e-3 * width + 0.05e-3 * rows * width

    def run(accepts, cost, every_row, why=None):
        rng = random.Random(0)
        policy = BatchDraftPolicy(["draft"], guard=False, every_row=every_row)
        for _ in range(3):  # (its own choices)
            closed_batch(policy, accepts, cost, rng)
        ends = [closed_batch(policy, accepts, cost, rng, why=why) for _ in range(5)]
        return [sum(e[i] for e in ends) / len(ends) for i in range(len(accepts))]

    mixed, alike = [0.9, 0.9, 0.85, 0.8, 0.3, 0.2, 0.1, 0.05], [0.8] * 8
    plain = max(closed_batch(None, mixed, cpu, random.Random(0)))  # (every row ends then)
    by_rate, why = run(mixed, cpu, False), []
    assert max(by_rate) > 1.05 * plain  # the rows that keep few drafts: 1.08x
    assert max(run(mixed, cpu, True, why)) < 1.03 * plain
    assert why and not {"probe", "explore"} & set(why)
    plain = max(closed_batch(None, alike, gpu, random.Random(0)))
    assert max(run(alike, gpu, True)) < 0.6 * plain
    assert max(run(mixed, gpu, True)) < 1.03 * plain


def test_a_closed_batch_drafts_by_what_its_unluckiest_row_keeps():
    """Rows in step end together, when the row that kept the fewest drafts does. A lookup
    that finds a match at half the steps, each row keeping 65% of its drafts where a step
    verifying one draft a row costs 1.33x a plain one: each row's mean gains a little
    (1.33 tokens a step), but the unluckiest of 8 keeps less, and priced by the rows' means
    the batch ended later than plain decoding (1.007x). Priced by the unluckiest row (the
    least mean less the deviations 8 rows spread over the steps they have left), it ends
    no later. Where drafts are always to be had (a model drafter) and a wider pass costs
    little, the batch still drafts, and ends well before plain decoding."""

    def cpu(rows, width):
        return 8.3e-3 + rows * (0.9e-3 + 0.65e-3 * (width - 1))

    def gpu(rows, width):
        return 5e-3 + 0.3e-3 * width + 0.05e-3 * rows * width

    def slowest(accepts, cost, found):
        rng = random.Random(0)
        policy, why = BatchDraftPolicy(["ngram"], guard=False), []
        for _ in range(3):  # (its own choices)
            closed_batch(policy, accepts, cost, rng, found=found)
        ends = [closed_batch(policy, accepts, cost, rng, why=why, found=found) for _ in range(5)]
        return max(sum(e[i] for e in ends) / len(ends) for i in range(len(accepts))), why

    rows = [0.65] * 8
    plain = max(closed_batch(None, rows, cpu, random.Random(0)))
    assert slowest(rows, cpu, 0.5)[0] < 1.003 * plain
    plain = max(closed_batch(None, rows, gpu, random.Random(0)))
    ends, why = slowest(rows, gpu, None)
    assert ends < 0.75 * plain and why.count("closed") > 0.5 * len(why)


def test_a_closed_batch_probes_a_new_drafter_only_where_its_step_could_pay():
    """A drafter no step has used is priced by a guess: a closed batch probes it only
    where the rule could take it at the least its step may cost, no less than a step of as
    many rows verifying as many drafts (or fewer) with the drafter that ran one. Where that
    step cost 8 rows 1.5x a plain one, a drafter guessed to keep half its drafts could not
    pay: the batch decodes plainly (its probes wait for other sizes). Where it cost 1.02x
    (a memory-bound GPU), it could: the batch probes it."""

    def probes(verify_cost):
        policy, rng = BatchDraftPolicy(["ngram", "draft"], guard=False), random.Random(0)
        for _ in range(10):
            policy.observe([(None, 0)] * 8, [(0, 0)] * 8, 15e-3)
        for _ in range(40):  # the lookup's steps at 8 rows, K = 1
            rows = [(0, 1)] * 8
            policy.observe(rows, outcomes_of(rows, rng, 0.5), verify_cost * 15e-3)
        policy.closed, why = True, []
        for _ in range(64):
            choice = policy.choose([RowAsk([1], None, 8, [None]) for _ in range(8)])
            why.append(choice.why)
            drafted = [(a, k) for a, k in choice.rows]
            policy.observe(drafted, outcomes_of(drafted, rng, 0.5), 15e-3)
        return why

    assert "probe" not in probes(1.5)
    assert "probe" in probes(1.02)


def test_a_closed_batch_in_step_weighs_the_ends_a_plan_puts_apart():
    """Rows in step (every row with the same budget left) end on one step, and their
    clients' next requests join together. A plan that drafts puts them apart: each row
    ends alone, a lone pass for its next request. A closed batch in step is charged that,
    spread over the run of speculative steps its plan starts, as long as a closed batch's
    runs with its drafter have lasted: where they last two steps (a lookup's matches come
    and go: a CPU's 8 rows), a plan that pays by itself (1.8 tokens a row a step at 1.13x a
    plain step's cost) is turned down, by 8 rows in step and by 7 in step beside one a step
    behind (a burst's last request); rows out of step take it, and so does a batch in
    step whose closed runs last (a memory-bound GPU's, where the charge is spread over the
    rows' life), and one whose runs were never measured (its first runs measure them)."""

    def policy_with(runs: int | None):
        policy, rng = BatchDraftPolicy(["ngram"], guard=False), random.Random(0)
        for _ in range(10):
            policy.observe([(None, 0)] * 8, [(0, 0)] * 8, 15e-3)
            policy.observe([(None, 0)], [(0, 0)], 8e-3)  # a lone row's pass
        for _ in range(40):  # the lookup's steps at 8 rows, K = 1: 1.13x a plain step
            rows = [(0, 1)] * 8
            policy.observe(rows, outcomes_of(rows, rng, 0.8), 17e-3)
        policy.closed = True
        for _ in range(6 if runs else 0):  # a closed batch's runs of `runs` steps
            for _ in range(runs):
                rows = [(0, 1)] * 8
                policy.observe(rows, outcomes_of(rows, rng, 0.8), 17e-3)
            policy.observe([(None, 0)] * 8, [(0, 0)] * 8, 15e-3)
        return policy

    def drafts(runs: int | None, lefts: list[int]) -> bool:
        choice = policy_with(runs).choose([RowAsk([0], None, 8, [3], left=n) for n in lefts])
        return any(k for _, k in choice.rows)

    in_step, apart = [40] * 8, [40 + i for i in range(8)]
    assert not drafts(2, in_step)
    assert not drafts(2, [40] * 7 + [41])  # 7 in step, the last request a step behind
    assert drafts(2, apart)
    assert drafts(40, in_step)
    assert drafts(None, in_step)


def test_batch_policy_tries_the_widths_its_line_prices_wrongly():
    """A policy that has seen steps of K = 2 .. 4 only (at B = 8 its K = 1 steps all came
    after plain stretches, with a catch-up, which the widths' own costs leave out) prices
    K = 1 by the line through them, dearer than it is, and K = 3 wins. Exploring the widths
    around the best one never runs K = 1 for long; exploring the least-known one runs it on
    the first exploring step, and K = 1 wins from there on (the widths above 4, which never
    ran, are each measured once on the way: their least possible price made them look
    best)."""
    steps = {1: 19.5e-3, 2: 24.5e-3, 3: 39.5e-3, 4: 40.5e-3, 5: 49.5e-3}

    def cost(width):
        return steps.get(width, 10e-3 * width)

    policy, rng = BatchDraftPolicy(["mtp"], guard=False), random.Random(1)  # its own choices
    for _ in range(10):
        policy.observe([(None, 0)] * 8, [(0, 0)] * 8, cost(1))
    for k in [2, 3, 4] * 30:
        outcomes = outcomes_of([(0, k)] * 8, rng, 0.75)
        policy.observe([(0, k)] * 8, outcomes, cost(k + 1))
    assert policy.costs.seconds(8, 1, (0,)) > 1.2 * cost(2)  # the line's price of K = 1
    ks = drive(policy, rows=8, accept=0.75, token_cost=0, cost=cost)
    assert ks[: policy.explore_every - 1] == [3] * (policy.explore_every - 1)
    assert sum(k == 1 for k in ks[:80]) >= 40
    assert sum(k == 1 for k in ks[-100:]) >= 70


@pytest.mark.parametrize("unlucky", [1, 3])
def test_a_lone_row_finds_the_wide_steps_its_line_prices_wrongly(unlucky):
    """A lone row's costs as measured on a 2-core x86 (MTP head, embedded pair: a plain step
    8 ms, K = 1 14 ms, K = 6 20 ms: a CPU's pass is far from a line in its width) and drafts
    kept with probability 0.85, the first `unlucky` speculative steps all rejected (a cold
    start on a hard stretch of text). The line through the few widths the probes ran prices
    K = 6 at twice its cost, and the policy stayed plain for hundreds of steps, probing
    K = 1 (1.0-1.6x plain over 300 steps); after three unlucky probes the acceptance they
    left spaced the next probes out by hundreds of steps. Probes and exploring steps that
    measure a width whose least possible cost would make it the best, at a hopeful
    acceptance while the drafter has few rounds behind it, find the wide steps: most of the
    last 100 steps draft 4 or more, 1.4x plain or more over the 300 steps (cold start
    included)."""
    cost = {0: 8, 1: 14, 2: 18, 3: 18, 4: 20.5, 5: 22, 6: 20, 7: 22, 8: 23}
    for seed in range(3):
        policy, rng = BatchDraftPolicy(["mtp"]), random.Random(seed)
        ks, tokens, seconds = [], 0, 0.0
        for _ in range(300):
            choice = policy.choose([RowAsk([0], None, 8, [None], [0])])
            (_, k), cold = choice.rows[0], sum(k > 0 for k in ks) < unlucky
            n = 0
            while n < k and not cold and rng.random() < 0.85:
                n += 1
            ks.append(k)
            step = cost[k] * 1e-3 * rng.uniform(0.95, 1.05)
            tokens, seconds = tokens + 1 + n, seconds + step
            policy.observe(choice.rows, [(k, n)], step, window=choice.window)
        assert sum(k >= 4 for k in ks[-100:]) >= 70, (seed, ks)
        assert tokens / seconds >= 1.4 / 8e-3, seed


def _group_steps(asks, steps: int, head_ms: float, seed: int) -> list[tuple[int, bool]]:
    """A policy over rows of a group (arm 0: an MTP head keeping 60% of its drafts, arm 1:
    n-gram lookup keeping 75%) run for `steps`, a step costing 10 ms + 1 ms per draft
    position + `head_ms` per draft position if any row drafts with the head; per step its
    K and whether the head drafted."""
    policy, rng = BatchDraftPolicy(["mtp", "ngram"]), random.Random(seed)
    accept = {0: 0.6, 1: 0.75}
    out = []
    for _ in range(steps):
        choice = policy.choose(asks)
        outcomes = []
        for arm, k in choice.rows:
            n = 0
            while arm is not None and n < k and rng.random() < accept[arm]:
                n += 1
            outcomes.append((k, n))
        big_k = max(k for _, k in choice.rows)
        head = any(arm == 0 and k for arm, k in choice.rows)
        seconds = 1e-3 * (10 + big_k + head_ms * big_k * head)
        policy.observe(choice.rows, outcomes, seconds, window=choice.window)
        out.append((big_k, head))
    return out


def test_batch_policy_tries_a_drafter_of_the_group_it_never_chose():
    """The head is tried first (equal priors, first in order) and costs 2 ms a draft; the
    lookup, never chosen, would keep more for nothing. Exploring steps that try the drafter
    the plan leaves out find it, and the rows draft with it from then on."""
    asks = [RowAsk([0, 1], None, 8, [None, None]) for _ in range(8)]
    steps = _group_steps(asks, 400, head_ms=2, seed=2)
    assert sum(k > 0 and not head for k, head in steps[-100:]) >= 80


def test_batch_policy_leaves_a_row_undrafted_rather_than_pay_a_drafter_for_it():
    """The lookup has drafts for seven rows; the head costs 6 ms a draft however few rows
    use it. The eighth row, with no lookup match, would draft with the head alone and make
    every step pay its passes: the policy drafts the seven with the lookup and the eighth
    not at all (each row choosing for itself drafted it with the head on every step)."""
    asks = [RowAsk([0, 1], None, 8, [None, None]) for _ in range(7)]
    asks.append(RowAsk([0, 1], None, 8, [None, 0]))
    heads = [head for k, head in _group_steps(asks, 300, head_ms=6, seed=3) if k]
    assert sum(heads[-100:]) <= 20
    assert len(heads) > 150  # it speculates: with the lookup, on most steps


def always_draft(engine: BatchEngine, arm: int, k: int = 2) -> None:
    """Replace the policy's choice by drafting k with `arm` (else a row's first drafter)
    wherever a row can draft, so that a test's steps do not hang on measured timings (the
    policy still observes every step, and knows which drafters the rows had, as after its
    own choice)."""

    def choose(asks):
        engine.policy._offered = {a for ask in asks for a in ask.arms}
        rows = []
        for ask in asks:
            pick = arm if arm in ask.arms else (ask.arms[0] if ask.arms else None)
            avail = None if pick is None else ask.available[ask.arms.index(pick)]
            n = 0 if pick is None else min(k, ask.limit, k if avail is None else avail)
            rows.append((pick, n) if n > 0 else (None, 0))
        return BatchChoice(max(n for _, n in rows), rows)

    engine.policy.choose = choose
    engine.policy.replan = lambda asks, choice: choose(asks)


def test_probes_still_measure_a_drafter_while_its_plans_would_slow_rows_behind():
    """Rows behind their pace, whose drafts the estimates price below what a wider pass
    costs them: no step is chosen for its rate, but the probes still come (their loss is
    budgeted; each followed by one step that prices its width), so that a drafter whose
    acceptance was underestimated can be found out."""
    policy, rng = BatchDraftPolicy(["mtp"], guard=False), random.Random(2)
    asks = [RowAsk([0], None, 8, [None], behind=True) for _ in range(2)]
    kinds = []
    for _ in range(400):
        choice = policy.choose(asks)
        outcomes = outcomes_of(choice.rows, rng, 0.1)
        kinds.append("plain" if not choice.num_draft else choice.why)
        policy.observe(choice.rows, outcomes, (10 + 5 * choice.num_draft) / 1e3)
    late = kinds[50:]
    assert late.count("probe") >= 3 and set(late) == {"plain", "probe", "follow"}
    assert all(kinds[i - 1] == "probe" for i in range(50, 400) if kinds[i] == "follow")


@pytest.mark.parametrize(
    "slack, plain, behind", [(0.02, 1e-9, True), (0.02, 1e3, False), (None, 1e-9, False)]
)
def test_a_rows_ledger_puts_it_behind_after_steps_slower_than_plain_ones(
    loaded, slack, plain, behind
):
    """The engine keeps each row's pace (`Row.lag`, `paced`) and asks the policy with it:
    where a plain step would take next to no time, every speculative step puts its rows
    behind plain decoding's pace and their next asks say so; where it would take far longer
    than any step, no row is ever behind; without a ledger (`pace_slack=None`), none."""
    model, tok, draft, _ = loaded["llama"]
    engine = engine_for(
        model, tok, {"draft-model": BatchDraftModel(draft)}, max_batch=4, pace_slack=slack
    )
    always_draft(engine, 0)
    engine.policy.costs.plain_seconds = lambda rows: plain
    drafted_before: set[int] = set()  # rows that had a speculative step before an ask
    flags = []
    real = engine._ask

    def ask(row):
        out = real(row)
        if row.id in drafted_before:
            flags.append(out.behind)
        return out

    engine._ask = ask
    real_pace = engine._pace

    def pace(rows, outcomes, seconds, turnover):
        real_pace(rows, outcomes, seconds, turnover)
        drafted_before.update(r.id for r in rows)

    engine._pace = pace
    requests = busy_requests(scored_vocab(model, tok), "draft-model", "auto", n=5)
    run_all(engine, requests)
    assert len(flags) > 20
    assert all(flags) if behind else not any(flags)


def test_a_row_joins_a_model_drafter_only_where_the_policy_drafts_with_it():
    """`join_pays`: with few steps seen at a batch size a row joins; where the drafter drafted
    in under `min_share` of the recent steps of that size it is turned away, but for every
    `probe_join`-th row (late checks, `probe=False`, never count); where it drafted in more,
    it joins."""
    policy = BatchDraftPolicy(["ngram", "draft"], probe_join=3)
    assert policy.join_pays(1, 8)  # nothing seen at B = 8
    for _ in range(40):  # B = 8: the lookup drafts, the draft model never
        policy.observe([(0, 2)] * 8, [(2, 1)] * 8, 0.01)
    for _ in range(40):  # B = 2: the draft model drafts
        policy.observe([(1, 2)] * 2, [(2, 1)] * 2, 0.01)
    assert policy.join_pays(0, 8)
    assert not any(policy.join_pays(1, 8, probe=False) for _ in range(10))
    assert [policy.join_pays(1, 8) for _ in range(6)] == [False, False, True] * 2
    assert policy.join_pays(1, 2, probe=False)


def test_a_joining_row_is_judged_at_the_batch_it_will_run_in(loaded):
    """A burst's first request, prefilled alone while the others arrive, is judged for its
    model drafter at the batch they make together (they join within a step or two), not as
    a lone row; a row joining a batch that will run closed (full, nothing waiting) gets no
    probe join (a closed batch runs no probe), one joining while requests wait may."""
    model, tok, draft, _ = loaded["llama"]
    drafters = {"ngram": BatchNgram(), "draft-model": BatchDraftModel(draft)}
    engine = engine_for(model, tok, drafters, max_batch=4, prefill_step=16)
    judged, join_pays = [], engine.policy.join_pays

    def watched(arm, rows, probe=True, *args, late=False, **kwargs):
        if not late:
            judged.append((rows, probe, bool(engine.waiting)))
        return join_pays(arm, rows, probe, *args, late=late, **kwargs)

    engine.policy.join_pays = watched
    vocab = scored_vocab(model, tok)
    requests = busy_requests(vocab, "all", "auto", n=6)
    outputs = [[] for _ in requests]

    def add(i):
        def emit(item):
            if item.token is not None:
                outputs[i].append(item.token)

        engine.add(BatchRequest(emit=emit, **requests[i]))

    add(1)  # 30 prompt tokens: two chunks of 16
    engine.step()
    for i in (0, 2, 3, 4, 5):
        add(i)
    while engine.busy:
        engine.step()
    assert judged[0] == (4, True, True)  # the first row, with the others waiting
    assert all(probe == (rows < 4 or waiting) for rows, probe, waiting in judged)
    assert any(not probe for _, probe, _ in judged)
    for req, tokens in zip(requests, outputs, strict=True):
        plain = mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"])
        assert tokens == plain.tokens


def test_a_late_join_must_repay_its_feed_within_the_life_the_row_has_left():
    """A row that left a model drafter out at joining and would take it in late feeds it its
    whole sequence, while the batch waits. Where the drafter drafts at that size, a row with
    most of its budget ahead takes it in; a row about to end (the last row of a burst, 2
    tokens left, 150 of history) does not, whatever the drafter does there; an admission
    (not late) is judged as before. While the drafter's cost per token is unmeasured, a late
    join goes ahead (its steps must be measured)."""
    policy = BatchDraftPolicy(["ngram", "draft"])
    assert policy.join_pays(1, 1, False, 150, 2.0, False, late=True)  # nothing measured
    for _ in range(40):  # a lone row drafting with the draft model: 8 ms a plain step
        policy.observe([(None, 0)], [(0, 0)], 8e-3)
        policy.observe([(1, 2)], [(2, 1)], 10e-3)
    for tokens in (100, 150, 200):  # 0.1 ms a token fed (the first join compiles: untimed)
        policy.observe_join(1, tokens, tokens * 0.1e-3)
    assert policy.join_pays(1, 1, False, 150, 2.0, False)  # the drafter pays at this size
    assert not policy.join_pays(1, 1, False, 150, 2.0, False, late=True)
    assert not policy.join_pays(1, 1, False, 150, 40.0, False, late=True)  # 15 ms > 3% of 320
    assert policy.join_pays(1, 1, False, 150, 200.0, False, late=True)  # 15 ms < 3% of 1.6 s


def test_a_size_the_policy_has_not_seen_is_priced_by_its_cost_model():
    """At a batch size without steps of its own (7 rows, on the way down from 8), whether a
    row joins the draft model follows the cost model fitted at the sizes seen: where verifying
    costs as much as a plain step per draft (compute-bound) it does not join, and a late check
    does not take it in; where verifying is nearly free it joins. A drafter never measured
    joins (its steps must be measured)."""
    assert BatchDraftPolicy(["draft"]).join_pays(0, 7, probe=False)
    rng = random.Random(0)
    for per_draft, pays in [(10e-3, False), (0.2e-3, True)]:
        policy = BatchDraftPolicy(["draft"])
        for _ in range(20):
            policy.observe([(None, 0)] * 8, [(0, 0)] * 8, 10e-3)
            policy.observe([(None, 0)] * 1, [(0, 0)] * 1, 2e-3)
        for k in [1, 2, 3] * 10:
            outcomes = [(k, sum(rng.random() < 0.7 for _ in range(k))) for _ in range(8)]
            policy.observe([(0, k)] * 8, outcomes, 10e-3 + per_draft * k)
        assert 7 not in policy._use
        assert policy.join_pays(0, 7, probe=False) is pays


@pytest.mark.parametrize("rows, accept, token_cost", [(8, 0.8, 0.3), (4, 0.6, 0.05), (1, 0.9, 0.0)])
def test_the_policy_stops_its_search_past_the_best_k_without_changing_its_choice(
    rows, accept, token_cost
):
    """Planning stops at a K well behind the best (past best + 1) and never plans beyond
    what any row can draft (lookups with matches of 0 to 6 tokens, a draft model): with a
    step's cost growing with K, every choice equals the one of a search over every K, with
    fewer plans made (a cap on K too low fails it)."""
    import copy

    policy, rng = BatchDraftPolicy(["ngram", "draft"]), random.Random(3)
    planned = {"full": 0, "cut": 0}
    for step in range(150):
        asks = [
            RowAsk([0, 1], None, 8, [rng.choice([0, 1, 3, 6]), None], [0, 0]) for _ in range(rows)
        ]
        full = copy.deepcopy(policy)
        full.stop_below = 0.0
        for name, p in (("full", full), ("cut", policy)):
            plan = p._merged_plan
            p._merged_plan = lambda *a, plan=plan, name=name, **k: (
                planned.__setitem__(name, planned[name] + 1) or plan(*a, **k)
            )
        wide, choice = full.choose(asks), policy.choose(asks)
        del policy._merged_plan
        assert (wide.num_draft, wide.rows, wide.only, wide.probe) == (
            choice.num_draft, choice.rows, choice.only, choice.probe,
        ), step  # fmt: skip
        outcomes = []
        for _, k in choice.rows:
            outcomes.append((k, sum(1 for _ in range(k) if rng.random() < accept)))
        width = 1 + choice.num_draft
        seconds = 1e-3 * (1 + token_cost * rows * width + 0.2 * width)
        policy.observe(choice.rows, outcomes, seconds, window=choice.window)
    assert planned["cut"] < planned["full"]


def _realised(
    policy: BatchDraftPolicy, spec_ms: float, hidden_ms: float, steps: int = 800
) -> tuple[float, float]:
    """Tokens per ms over `steps` of 8 rows (acceptance 0.5): a plain step costs 10 ms, a
    speculative one `spec_ms` + 4 ms per draft; each of the 3 plain steps after a speculative
    one costs `hidden_ms` more (what the step costs leave out: a pipeline of plain steps to
    start again, rows out of step). Returns the rate and the share of plain steps."""
    rng, since, tokens, ms, plain = random.Random(4), 99, 0, 0.0, 0
    for _ in range(steps):
        asks = [RowAsk([0], None, 8, [None]) for _ in range(8)]
        choice = policy.choose(asks)
        outcomes = outcomes_of(choice.rows, rng, 0.5)
        if choice.num_draft:
            cost, since = spec_ms + 4 * choice.num_draft, 0
        else:
            cost, since = 10 + (hidden_ms if since < 3 else 0), since + 1
            plain += 1
        tokens += sum(1 + n for _, n in outcomes)
        ms += cost
        policy.observe(choice.rows, outcomes, cost / 1e3, window=choice.window)
    return tokens / ms, plain / steps


def test_the_guard_decodes_plainly_where_speculation_realises_less():
    """Plain steps after a speculative one cost 8 ms more, which a step's own cost cannot
    show: a plain step looks dear, so the policy alone speculates (a step of K = 1 costs
    16.5 ms for 12 tokens) and realises about 0.72 tokens/ms against plain decoding's 0.8;
    its guard, comparing windows of the policy's steps with plain ones, decodes plainly
    nearly all the time. Where speculation pays despite that cost (12 ms a step of K = 1),
    the guard's plain windows cost it little."""
    alone, _ = _realised(BatchDraftPolicy(["draft"], guard=False), spec_ms=12.5, hidden_ms=8)
    guarded, share = _realised(BatchDraftPolicy(["draft"]), spec_ms=12.5, hidden_ms=8)
    assert alone < 0.74 and guarded > 0.76 and share > 0.85
    alone, _ = _realised(BatchDraftPolicy(["draft"], guard=False), spec_ms=8, hidden_ms=8)
    guarded, share = _realised(BatchDraftPolicy(["draft"]), spec_ms=8, hidden_ms=8)
    assert alone > 0.9 and guarded > 0.97 * alone and share < 0.15


def test_the_guards_plain_windows_are_answered_without_the_rows_asks():
    """Where the guard's running window bars every drafter the rows have, `barred` answers
    for the step without the rows' asks (the engine then skips each row's n-gram lookup and
    drafters' backlogs: a host's work per row and step), with the choice `choose` would have
    made and the same state after it; elsewhere it leaves the choice to `choose`."""
    policy, rng, answered = BatchDraftPolicy(["draft"]), random.Random(4), 0
    since = 99
    for _ in range(600):
        asks = [RowAsk([0], None, 8, [None]) for _ in range(8)]
        twin = copy.deepcopy(policy)
        choice = policy.barred(8, {0}, True)
        expected = twin.choose(asks)
        if choice is None:
            choice = policy.choose(asks)
        else:
            answered += 1
        assert (choice.num_draft, choice.rows, choice.window) == (
            expected.num_draft,
            expected.rows,
            expected.window,
        )
        assert (policy.guard.left, policy.guard.barred) == (twin.guard.left, twin.guard.barred)
        outcomes = [(k, sum(rng.random() < 0.5 for _ in range(k))) for _, k in choice.rows]
        if choice.num_draft:
            cost, since = 12.5 + 4 * choice.num_draft, 0
        else:
            cost, since = 10 + (8 if since < 3 else 0), since + 1
        policy.observe(choice.rows, outcomes, cost / 1e3, window=choice.window)
    assert answered > 400  # the guard led with plain decoding: most steps in its windows
    assert policy.barred(8, {0}, False) is None  # a row drafting a fixed k: the rows ask
    assert policy.barred(1, {0}, True) is None  # a lone row: no guard


def _group_realised(policy: BatchDraftPolicy, steps: int = 1500) -> tuple[float, float, float]:
    """Tokens per ms over `steps` of 8 rows of a group: arm 0 a model drafter (drafts kept
    with probability 0.8, 3 ms a draft position: its steps look good), whose joins cost 30
    ms (a row joins every 4th step, where `join_pays` takes it in: a cost no step shows),
    and arm 1 an n-gram lookup (kept 0.6, 1 ms a draft position); a plain step 10 ms (0.8
    tokens/ms). Returns the rate and the shares of steps that drafted with each arm."""
    rng, tokens, ms, used = random.Random(5), 0, 0.0, [0, 0]
    accept = {0: 0.8, 1: 0.6}
    for step in range(steps):
        joined = None
        if step % 4 == 0 and policy.join_pays(0, 8, True, 80, 64.0):
            joined, ms = {0: 0.03}, ms + 30
            policy.observe_join(0, 80, 0.03)
        asks = [RowAsk([0, 1], None, 8, [None, None], [0, 0]) for _ in range(8)]
        choice = policy.choose(asks)
        outcomes, arms = [], set()
        for arm, k in choice.rows:
            n = 0
            while arm is not None and n < k and rng.random() < accept[arm]:
                n += 1
            outcomes.append((k, n))
            if k:
                arms.add(arm)
        cost = 10 + choice.num_draft * (1 + 2 * (0 in arms))
        for arm in arms:
            used[arm] += 1
        tokens += sum(1 + n for _, n in outcomes)
        ms += cost
        policy.observe(choice.rows, outcomes, cost / 1e3, window=choice.window, joined=joined)
    return tokens / ms, used[0] / steps, used[1] / steps


def test_the_guard_bars_the_drafter_of_a_group_that_costs_more_than_it_adds():
    """A group of a model drafter whose steps look good but whose joins cost more than it
    adds, and an n-gram lookup that pays: the guard, judging each drafter against the steps
    without it, bars the model drafter (its rows stop joining it) and keeps the lookup. A
    guard over the group as a whole could only keep both or bar both: it barred both, and
    the probe joins left it under plain decoding (0.74 tokens/ms against 0.8); unguarded,
    the policy drafts with both and pays every join (1.03)."""
    alone, _, _ = _group_realised(BatchDraftPolicy(["draft", "ngram"], guard=False))
    guarded, model, lookup = _group_realised(BatchDraftPolicy(["draft", "ngram"]))
    assert model < 0.1 and lookup > 0.8, (model, lookup)
    assert guarded > 1.1 and guarded > 1.08 * alone, (guarded, alone)


def _paced_batch(slack: float | None, steps: int = 600) -> tuple[float, float, float]:
    """8 rows: four whose drafts the target keeps with probability 0.85, four with nothing
    to draft (a lookup that finds no match); a plain step 10 ms, a step verifying K drafts
    10 ms + 1.5 / 5 / 6 ms for K = 1 / 2 / 3 (a 2-core CPU's widths) and 3 ms a draft
    beyond. Each row keeps the engine's ledger (`BatchEngine._pace`, `pace_slack`).
    Returns the undrafted rows' time per token over a plain step's (their slowdown), the
    drafted rows' and the batch's tokens per ms."""
    extra = {1: 1.5, 2: 5.0, 3: 6.0}
    policy, rng = BatchDraftPolicy(["ngram"], guard=False), random.Random(7)
    lag, paced, tokens, ms = [0.0] * 8, [0.0] * 8, [0] * 8, 0.0
    for _ in range(steps):
        plain = policy.costs.plain_seconds(8)
        asks = [
            RowAsk([0], None, 8, [None if i < 4 else 0], [0],
                   behind=slack is not None and lag[i] > slack * paced[i])
            for i in range(8)
        ]  # fmt: skip
        choice = policy.choose(asks)
        outcomes = outcomes_of(choice.rows, rng, 0.85)
        big_k = choice.num_draft
        cost = 10.0 + extra.get(big_k, 6.0 + 3.0 * (big_k - 3)) if big_k else 10.0
        ms += cost
        for i, (_, kept) in enumerate(outcomes):
            tokens[i] += 1 + kept
            if big_k:
                lag[i] += cost / 1e3 - (1 + kept) * plain
            paced[i] += (1 + kept) * plain
        policy.observe(choice.rows, outcomes, cost / 1e3, window=choice.window)
    slowdown = max(ms / (10.0 * tokens[i]) for i in range(4, 8))
    return slowdown, min(tokens[:4]) / ms, sum(tokens) / ms


def test_speculation_in_a_batch_does_not_slow_a_row_that_cannot_draft():
    """Weighed as a whole, the batch gains by drafting for the rows whose drafts are kept,
    and the rows with nothing to draft pay the wider passes: they ran slower than
    plain decoding would have (1.4x). With each row's ledger, a step that would slow a
    row already behind its pace is not taken: those rows stay within a few percent of
    plain decoding's pace, and the rows that draft still run faster than it."""
    unfair, lucky_unfair, _ = _paced_batch(None)
    assert unfair > 1.3 and lucky_unfair > 0.15, (unfair, lucky_unfair)
    slowdown, lucky, batch = _paced_batch(0.02)
    assert slowdown < 1.04, slowdown
    assert lucky > 0.104 and batch >= 0.8, (lucky, batch)  # plain: 0.1 a row, 0.8 in all


def test_the_policy_repeats_a_plain_answer_while_the_asks_stay_the_same():
    """While plain decoding wins, rows unchanged, the full comparison runs on every
    `recheck`-th step only; a change in what rows can draft (a lookup that found a match)
    runs it at once, and probes still come on schedule."""
    policy = BatchDraftPolicy(["ngram"], recheck=4, guard=False)
    drive(policy, rows=8, accept=0.8, token_cost=1.0, steps=200)  # compute-bound: plain
    full = []
    policy._gains = lambda hopeful=False, own=policy._gains: (
        own(hopeful) if hopeful else full.append(1) or own()
    )
    asks = [RowAsk([0], None, 8, [0]) for _ in range(8)]
    policy._since_spec, policy._probe_every = 0, 12
    ks, evaluated = [], []
    for step in range(40):
        if step == 21:
            asks[3] = RowAsk([0], None, 8, [None])
        before = len(full)
        choice = policy.choose(asks)
        ks.append(choice.num_draft)
        evaluated.append(len(full) > before)
        outcomes = [(k, 0) for _, k in choice.rows]
        seconds = 1e-3 * (1 + 8 * (1 + choice.num_draft))
        policy.observe(choice.rows, outcomes, seconds, window=choice.window)
    probes = [i for i, k in enumerate(ks) if k and not ks[i - 1]]  # (each followed by a step
    assert len(ks) - 2 * len(probes) > 30 and probes  # that prices its width)
    assert evaluated[21] and all(evaluated[i] for i in probes)
    assert 40 // 4 <= sum(evaluated) <= 40 // 4 + 2 * len(probes) + 2
    policy.recheck = 1
    full.clear()
    for _ in range(10):
        choice = policy.choose(asks)
        policy.observe(choice.rows, [(k, 0) for _, k in choice.rows], 0.01, window=choice.window)
    assert len(full) >= 7  # (the first few may still repeat the answer held: recheck - 1)


@pytest.mark.parametrize("group", [False, True])
def test_a_row_that_skipped_its_drafter_joins_it_late(loaded, group):
    """Rows joining a batch of three while the policy has not drafted with the draft model at
    that size leave it out (decoding plainly, or with the lookup of their group); when the
    others are done and one row is left (a size where it drafts), the row takes it in late and
    drafts with it. Every row's tokens equal plain single-stream decoding."""
    model, tok, draft, _ = loaded["llama"]
    tok = with_eos(tok)
    drafters = {"ngram": BatchNgram(), "draft-model": BatchDraftModel(draft)}
    engine = engine_for(model, tok, drafters, max_batch=3, prefill_step=64)
    policy = engine.policy
    policy.probe_join, policy.join_budget = 10**6, 0.0  # the share alone decides
    arm = engine.names.index("draft-model")
    for _ in range(20):  # the draft model never drafted at B = 2 or 3, always at B = 1
        for rows in (2, 3):
            policy.observe([(0, 1)] * rows, [(1, 1)] * rows, 0.01)
        policy.observe([(arm, 2)], [(2, 2)], 0.01)
    always_draft(engine, arm)
    requests = busy_requests(scored_vocab(model, tok), "all" if group else "draft-model", "auto")
    requests = [requests[i] for i in (1, 3, 2)]  # 25, 8 and 60 tokens
    results = run_all(engine, requests)
    for req, (tokens, _) in zip(requests, results, strict=True):
        assert (
            tokens
            == mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"]).tokens
        )
    short, longest = results[1][1].stats, results[2][1].stats
    assert short.drafter_rounds.get("draft-model", 0) == 0
    assert longest.drafter_rounds.get("draft-model", 0) > 0
    assert engine.cache is None and all(not d.rows for d in drafters.values())


def test_a_row_refilling_a_busy_batch_is_judged_at_the_batch_s_usual_size(loaded):
    """The draft model drafts at B = 1 and never at B = 2 or 3. A row that finds the batch empty
    right after it ran three rows (a busy batch refilling one request at a time) is judged at
    3: it leaves the draft model out, and takes it in late once the batch has run at one row
    for a while; the same row on a batch that was idle (new, or empty for longer than
    IDLE_RESET) joins it at once. Its tokens equal plain single-stream decoding always."""
    model, tok, draft, _ = loaded["llama"]
    tok = with_eos(tok)
    vocab = scored_vocab(model, tok)
    req = busy_requests(vocab, "draft-model", "auto")[2]  # 60 tokens
    plain = mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"]).tokens
    rounds = []
    for busy in (3.0, 0.0):
        engine = engine_for(model, tok, {"draft-model": BatchDraftModel(draft)}, max_batch=3)
        policy = engine.policy
        policy.probe_join, policy.join_budget = 10**6, 0.0  # the share alone decides
        for _ in range(20):
            for rows in (2, 3):
                policy.observe([(None, 0)] * rows, [(0, 0)] * rows, 0.01)
            policy.observe([(0, 2)], [(2, 2)], 0.01)
        always_draft(engine, 0)
        engine._size_seen, engine._last_decode = busy, time.perf_counter()
        ((tokens, final),) = run_all(engine, [req])
        assert tokens == plain
        rounds.append(final.stats.drafter_rounds.get("draft-model", 0))
    refilling, idle = rounds
    assert 0 < refilling < idle - 5, rounds
    # A batch that stood empty for longer than IDLE_RESET: a new spell, judged afresh.
    engine._size_seen, engine._last_decode = 3.0, time.perf_counter() - 2 * IDLE_RESET
    ((tokens, final),) = run_all(engine, [req])
    assert tokens == plain
    assert final.stats.drafter_rounds.get("draft-model", 0) == idle


def test_a_drafters_join_is_reported_apart_from_the_steps_time(loaded, fake_clock):
    """A model drafter's join (taking 50 ms here) is its row's cost, once: it comes with
    the next step observed as `joined`, and no step's own time includes it (fitted as a
    step's cost it would price every speculative step as the first after a join). The
    policy times the joins per token fed (of 16 tokens or more, the first one left out:
    here the 2 longest prompts, 31 and 51 tokens, the second of them timed)."""
    model, tok, draft, _ = loaded["llama"]
    drafter = BatchDraftModel(draft)
    engine = engine_for(model, with_eos(tok), {"draft-model": drafter}, max_batch=1)
    events = []
    join, observe = drafter.join, engine.policy.observe

    def slow_join(*args):
        join(*args)
        fake_clock.advance(0.05)
        events.append("join")

    def record(rows, outcomes, seconds, catch_up=0, window=None, joined=None, **kw):
        events.append((seconds, sum((joined or {}).values())))
        observe(rows, outcomes, seconds, catch_up, window, joined=joined, **kw)

    drafter.join, engine.policy.observe = slow_join, record
    always_draft(engine, 0)
    requests = busy_requests(scored_vocab(model, tok), "draft-model", "auto", n=4)
    run_all(engine, requests)
    after = [events[i + 1] for i, e in enumerate(events[:-1]) if e == "join"]
    assert len(after) == 4 and all(joined >= 0.05 for _, joined in after), events
    steps = [seconds for e in events if e != "join" for seconds, _ in [e]]
    assert max(steps) < 0.05, events
    assert engine.policy._join_cost[0] > 0.05 / (max(len(r["prompt"]) for r in requests) + 2)


def test_the_guard_charges_joins_to_their_drafter_and_stands_aside_for_a_lone_row():
    """Join time reported with a step goes to its drafter's allowed side of the guard (no
    tokens), also when it came before steps the guard stood aside from; a drafter's first
    join (compiling its kernels) is not charged. A batch of one row is judged only for the
    drafters in `alone` (the engine's model drafters): without it a lone row is never
    barred and its joins are taken without the guard's verdict; with it, the model drafter
    is judged, the lone row's n-gram lookup still not."""
    policy = BatchDraftPolicy(["ngram", "draft"])
    for _ in range(3):
        policy.observe([(None, 0)] * 2, [(0, 0)] * 2, 0.01)
    policy.observe([(None, 0)] * 2, [(0, 0)] * 2, 0.01, joined={1: 5.0})  # compiling
    asks = [RowAsk([0, 1], None, 4, [4, None], [0, 0])] * 2
    choice = policy.choose(asks)
    assert choice.window == 0  # nothing barred: no size has measured either side yet
    policy.observe([(None, 0)] * 2, [(0, 0)] * 2, 0.01, 0, None, joined={1: 0.03})
    policy.observe(choice.rows, [(0, 0)] * 2, 0.01, 0, choice.window, joined={1: 0.02})
    entry = policy.guard.rates[2, 1, True]
    assert entry[0] == 2 and abs(entry[1] - 0.06) < 1e-9 and entry[2] == 1
    assert policy.guard.rates[2, 0, True] == [2.0, 0.01, 1.0]  # the lookup: no join
    lone = [RowAsk([1], None, 4, [None], [0])]
    assert all(policy.choose(lone).window is None for _ in range(100))
    policy.guard.rates[1, 1, True] = [1.0, 10.0, 20.0]  # its steps realised far less
    policy.guard.rates[1, 1, False] = [10.0, 1.0, 20.0]
    assert policy.guard.verdict(1, 1) < 1 and policy.join_pays(1, 1, probe=False)

    watched = BatchDraftPolicy(["ngram", "draft"], alone={1})
    for _ in range(3):
        watched.observe([(None, 0)], [(0, 0)], 0.01)
    lookup = [RowAsk([0], None, 4, [4], [0])]
    assert all(watched.choose(lookup).window is None for _ in range(20))
    assert watched.barred(1, {0}, True) is None  # the lookup may draft: the rows ask
    assert watched.choose(lone).window == 0  # judged (allowed: nothing measured yet)
    watched.guard.rates[1, 1, True] = [1.0, 10.0, 20.0]
    watched.guard.rates[1, 1, False] = [10.0, 1.0, 20.0]
    assert not watched.join_pays(1, 1, probe=False)


def _lone_user(
    policy: BatchDraftPolicy,
    join_ms: float,
    requests: int = 60,
    *,
    seed: int = 4,
    accept: tuple[float, float] = (0.8, 0.8),
    per_draft: float = 2.0,
    own: bool = False,
    measured_from: int = 0,
) -> tuple:
    """A lone user's `requests` of 64 tokens each: a plain step 10 ms (0.1 tokens/ms); a
    speculative one 11 ms + `per_draft` ms a draft, each draft kept with probability
    `accept[0]` over a request's first 16 tokens and `accept[1]` after (by default 0.8
    throughout: K = 2 about 2.4 tokens in 15 ms, 0.16 tokens/ms); a request whose row joins
    the model drafter (where `join_pays`) pays `join_ms` to feed it an 80-token prompt, a
    cost no step shows. With `own`, the row's record of its rounds (`RowRecord`) gives its
    asks their levels and its ledger (`BatchEngine._pace`, a slack of 2%) their `behind`,
    as the engine's rows do. Returns the tokens per ms of the requests from `measured_from`
    on and the requests that joined."""
    from mlx_spec.decoding.batch_policy import RowRecord

    rng, tokens, ms, joins = random.Random(seed), 0, 0.0, 0
    for request in range(requests):
        if request == measured_from:
            tokens, ms = 0, 0.0
        has, record, joined = policy.join_pays(0, 1, True, 80, 64.0), RowRecord(), None
        if has:
            joins, ms, joined = joins + 1, ms + join_ms, {0: join_ms / 1e3}
            policy.observe_join(0, 80, join_ms / 1e3)
        done, lag, paced = 0, 0.0, 0.0
        while done < 64:
            limit = min(8, 63 - done)
            if not has:
                ask = RowAsk([], None, 0, [])
            elif own:
                ask = record.ask([0], None, limit, [None], [0], behind=lag > 0.02 * paced)
            else:
                ask = RowAsk([0], None, limit, [None])
            choice = policy.choose([ask])
            outcomes = outcomes_of(choice.rows, rng, accept[0] if done < 16 else accept[1])
            if own and choice.num_draft:
                record.drafted(0, choice.rows[0][1], outcomes[0][1])
            cost = 10 + (1 + per_draft * choice.num_draft if choice.num_draft else 0)
            tokens, done = tokens + 1 + outcomes[0][1], done + 1 + outcomes[0][1]
            ms += cost
            plain = policy.costs.plain_seconds(1)
            if choice.num_draft:
                lag += cost / 1e3 - (1 + outcomes[0][1]) * plain
            paced += (1 + outcomes[0][1]) * plain
            policy.observe(choice.rows, outcomes, cost / 1e3, window=choice.window, joined=joined)
            joined = None
    return tokens / ms, joins


def test_the_guard_watches_a_lone_rows_model_drafter_whose_joins_cost_more_than_it_adds():
    """A lone user whose model drafter's steps pay (0.16 tokens/ms against plain decoding's
    0.1) but whose joins cost about half a request's plain time: unguarded at one row, every
    request joins it and the user is slower than plain decoding; with the drafter in
    `alone`, the guard counts the joins against its steps, turns rows away from it (a few
    still join, to keep it measured) and the user gets about plain decoding's rate. Where
    the joins are cheap, watching the lone row costs nothing."""
    unguarded, joins = _lone_user(BatchDraftPolicy(["draft"]), join_ms=300)
    assert unguarded < 0.096 and joins == 60
    watched, joins = _lone_user(BatchDraftPolicy(["draft"], alone={0}), join_ms=300)
    assert watched > 0.098 and joins < 10, (watched, joins)
    unguarded, _ = _lone_user(BatchDraftPolicy(["draft"]), join_ms=20)
    watched, joins = _lone_user(BatchDraftPolicy(["draft"], alone={0}), join_ms=20)
    assert unguarded > 0.15 and watched > 0.99 * unguarded and joins == 60


def _lone_mtp_user(policy: BatchDraftPolicy, seed: int, early=0.4, late=0.85) -> tuple:
    """`_lone_user` with an MTP head: 24 requests, the last 12 measured; its join cheap (3 ms
    for the prompt), its drafts kept with probability `early` over a request's first 16
    tokens, `late` after (a generation's opening is hard to guess), 4 ms a draft (drafting
    two throughout at 0.4 then 0.85: about 0.116 tokens/ms); the rows' own records give
    their levels."""
    return _lone_user(
        policy, 3.0, 24, seed=seed, accept=(early, late), per_draft=4.0, own=True,
        measured_from=12,
    )  # fmt: skip


def test_a_lone_rows_trivially_cheap_drafter_stays_joined_through_hard_openings():
    """A lone user's MTP head, cheap to join and drafting well but for each request's
    opening: the first requests' openings priced it as a loss, the guard's verdict read a
    loss, and every later request was turned away from it (0.1 tokens/ms: plain decoding,
    where drafting two a step throughout gives about 0.116). A join within a third of
    `join_budget` is always taken, and the row's record of its own rounds weighs the
    recent ones most, so that the policy drafts where the text lets the head guess:
    over 1.1x of plain decoding at every seed. A drafter that never guesses well costs
    the user its joins and probes, under 2%; one that always does, drafts throughout."""
    for seed in range(4):
        rate, joins = _lone_mtp_user(BatchDraftPolicy(["mtp"], alone={0}), seed)
        assert rate > 0.11 and joins == 24, (seed, rate, joins)
        bad, _ = _lone_mtp_user(BatchDraftPolicy(["mtp"], alone={0}), seed, 0.3, 0.3)
        assert bad > 0.098, (seed, bad)
        good, _ = _lone_mtp_user(BatchDraftPolicy(["mtp"], alone={0}), seed, 0.85, 0.85)
        assert good > 0.125, (seed, good)


def test_only_a_trivially_cheap_join_is_taken_against_the_guard():
    """A join within a third of `join_budget` is taken whatever the guard's verdict and
    however little the policy drafted with the drafter at that size; a dearer one (within
    the budget) is still turned away there."""
    policy = BatchDraftPolicy(["mtp"], alone={0}, join_budget=0.03)
    policy.observe_join(0, 100, 5.0)  # the first: compiling
    policy.observe_join(0, 100, 0.002)  # 20 us a token
    for _ in range(40):  # a lone row that could draft with it, plain steps only: 10 ms
        policy.observe([(0, 0)], [(0, 0)], 0.01)
    policy.guard.rates[1, 0, True] = [5.0, 1.0, 20.0]  # its steps realised half as much
    policy.guard.rates[1, 0, False] = [10.0, 1.0, 20.0]
    # 200 tokens x 20 us = 4 ms: 0.6% of 64 plain steps; 600 tokens: 1.9%, within 3%
    assert policy.join_pays(0, 1, probe=False, tokens=200, life=64)
    assert policy._cheap(0, 1, 600, 64) and not policy._cheap(0, 1, 600, 64, 0.01)
    assert not policy.join_pays(0, 1, probe=False, tokens=600, life=64)


def test_a_rows_record_weighs_its_recent_rounds_most():
    """A row whose first rounds kept nothing and whose last ones kept everything stands
    above the drafter's acceptance: its record weighs each round `RowRecord.DECAY` times
    the next."""
    from mlx_spec.decoding.batch_policy import RowRecord

    policy = BatchDraftPolicy(["mtp"])
    for _ in range(30):  # the head keeps half its drafts over all rows
        policy.observe([(0, 2)] * 2, [(2, 2), (2, 0)], 1e-2)
    turned, steady = RowRecord(), RowRecord()
    for kept in [0] * 6 + [2] * 6:
        turned.drafted(0, 2, kept)
    for kept in [2, 0] * 6:
        steady.drafted(0, 2, kept)
    hits, trials = turned.own[0]
    assert trials[0] == pytest.approx(sum(RowRecord.DECAY**i for i in range(12)))
    asks = [r.ask([0], None, 8, [None], [0]) for r in (turned, steady)]
    policy._prepare(asks)
    assert asks[0].levels[0] > 0 and abs(asks[1].levels[0]) <= 1, [a.levels for a in asks]


def test_the_guard_leaves_out_a_shapes_first_step_that_built_its_kernels():
    """A speculative shape's first step costing far over its price (MLX building kernels on
    a GPU) counts for neither the step costs nor the guard: the next step of the shape
    does."""
    policy = BatchDraftPolicy(["draft"])
    for _ in range(3):
        policy.observe([(None, 0)] * 2, [(0, 0)] * 2, 0.01)
    asks = [RowAsk([0], None, 4, [None])] * 2
    choice = policy.choose(asks)
    assert choice.window == 0
    rows = [(0, 1)] * 2
    policy.observe(rows, [(1, 1)] * 2, 2.0, window=choice.window)  # built its kernels
    assert (2, 0, True) not in policy.guard.rates
    policy.observe(rows, [(1, 1)] * 2, 0.012, window=choice.window)
    assert policy.guard.rates[2, 0, True] == [4.0, 0.012, 1.0]


def test_a_cheap_join_is_taken_unless_the_policy_hardly_drafted_with_it_lately():
    """Where a drafter's measured joins cost, for as many rows as the batch holds, at most
    `join_budget` of the plain time of a row's expected life, a row joins it at a size the
    policy has few steps of; where it has steps of that size that could draft with it and
    drafted with it in under `min_share` of them, a row joins it only as every
    `probe_join`-th turned away, cheap or not (a lone user's draft model on a fast CPU: every
    request fed it its prompt for steps the policy then decoded plainly); where it drafted
    with it, rows join. The first join (compiling) is not timed; until one is, rows join."""
    policy = BatchDraftPolicy(["mtp"], join_budget=0.03)
    assert policy.join_pays(0, 4, probe=False, tokens=10**4, life=1)  # to time a join
    policy.observe_join(0, 100, 5.0)  # the first: compiling
    assert 0 not in policy._join_cost
    policy.observe_join(0, 100, 0.002)  # 20 us a token
    for _ in range(3):
        policy.observe([(0, 0)] * 2, [(0, 0)] * 2, 0.01)  # plain steps of 2 rows: 10 ms
    # 4 rows x 200 tokens x 20 us = 16 ms against 3% of 64 steps x 10 ms = 19.2 ms
    assert policy._cheap(0, 4, 200, 64) and not policy._cheap(0, 4, 400, 64)
    assert policy.join_pays(0, 4, probe=False, tokens=200, life=64)
    for _ in range(40):
        policy.observe([(0, 0)] * 4, [(0, 0)] * 4, 0.01)  # B = 4: never drafted
    assert not policy.join_pays(0, 4, probe=False, tokens=200, life=64)
    joined = [policy.join_pays(0, 4, tokens=200, life=64) for _ in range(2 * policy.probe_join)]
    assert joined.count(True) == 2 and joined[policy.probe_join - 1]
    for _ in range(40):  # now it drafts with it
        policy.observe([(0, 2)] * 4, [(2, 1)] * 4, 0.015)
    assert policy.join_pays(0, 4, probe=False, tokens=400, life=64)


def test_a_guard_reading_plain_against_plain_takes_no_join():
    """At a size where the policy has hardly drafted with a model drafter, the guard's
    allowed windows were plain steps too: a ratio of 1 or more there is noise, and rows do
    not join the drafter for it (every `probe_join`-th still does); where the policy drafts
    with it, the guard's verdict stands."""
    policy = BatchDraftPolicy(["draft"])
    for _ in range(40):  # 8 rows that could draft with it, plain steps only
        policy.observe([(0, 0)] * 8, [(0, 0)] * 8, 0.01)
    policy.guard.rates[8, 0, True] = [80.0, 1.0, 20.0]  # allowed: as good as barred
    policy.guard.rates[8, 0, False] = [80.0, 1.0, 20.0]
    assert policy.guard.verdict(8, 0) == 1.0
    assert not policy.join_pays(0, 8, probe=False)
    assert [policy.join_pays(0, 8) for _ in range(policy.probe_join)][-1]
    for _ in range(40):  # now it drafts with it
        policy.observe([(0, 2)] * 8, [(2, 1)] * 8, 0.015)
    assert policy.join_pays(0, 8, probe=False)


def test_rows_turned_away_from_a_losing_drafter_join_the_rarer_the_more_it_loses():
    """Where the guard found a drafter's steps realising less, the rows that still join it
    (to keep it measured) come the rarer the worse its verdict: every `probe_join`-th row
    at a verdict near 1 or none, every 32nd at 0.8 (a join feeds it a whole prompt, for a
    loss the guard already knows), never rarer than `probe_join` squared."""

    def joins(ratio: float | None, rows: int = 200) -> list[int]:
        policy = BatchDraftPolicy(["draft"], join_budget=0.0)
        if ratio is not None:
            policy.guard.rates[8, 0, True] = [ratio * 100.0, 1.0, 20.0]
            policy.guard.rates[8, 0, False] = [100.0, 1.0, 20.0]
            assert abs(policy.guard.verdict(8, 0) - ratio) < 1e-9
        else:  # no verdict: the share of steps drafting with it decides (none: it loses)
            for _ in range(40):
                policy.observe([(0, 0)] * 8, [(0, 0)] * 8, 0.01)
        return [i for i in range(rows) if policy.join_pays(0, 8)]

    assert joins(None)[:3] == [7, 15, 23]
    assert joins(0.97)[:3] == [7, 15, 23]
    assert joins(0.8)[:3] == [31, 63, 95]
    assert joins(0.2)[:2] == [63, 127]
    assert joins(1.1) == list(range(200))  # it pays: every row joins


def test_a_failed_join_fails_its_rows_and_the_engine_serves_on(loaded):
    """A drafter's join that raises (out of memory, say) ends the joining rows with the
    error, once; it is not retried every step (which held those rows, and every request
    after them, forever); the rows decoding meanwhile and later requests are served, each
    equal to its output alone."""
    model, tok, draft, _ = loaded["llama"]
    vocab = scored_vocab(model, tok)
    reqs = busy_requests(vocab, "draft-model", 2, n=3)
    for r in reqs:
        r["sampling"] = SamplingConfig(temperature=0.0)

    def fresh_engine():
        drafters = {"draft-model": BatchDraftModel(draft)}
        return engine_for(model, with_eos(tok), drafters, max_batch=4)

    alone = [run_all(fresh_engine(), [r])[0][0] for r in reqs]
    engine = fresh_engine()
    drafter = engine.drafters["draft-model"]
    join, calls = drafter.join, []

    def failing_join(row, *args):
        calls.append(row)
        if len(calls) == 2:
            raise MemoryError("no room for the drafter's cache")
        return join(row, *args)

    drafter.join = failing_join
    outputs, errors = [[] for _ in reqs], [[] for _ in reqs]

    def emitter(i):
        def emit(item):
            if isinstance(item, Exception):
                errors[i].append(item)
            elif item.token is not None:
                outputs[i].append(item.token)

        return emit

    def drain():
        steps = 0
        while engine.busy and steps < 500:
            steps += 1
            try:
                engine.step()
            except MemoryError:
                pass
        assert not engine.busy

    engine.add(BatchRequest(emit=emitter(0), **reqs[0]))
    engine.step()
    engine.step()  # the first row decodes
    for i in (1, 2):
        engine.add(BatchRequest(emit=emitter(i), **reqs[i]))
    drain()
    failed = [i for i in range(3) if errors[i]]
    assert failed and 0 not in failed and all(len(errors[i]) == 1 for i in failed)
    for i in set(range(3)) - set(failed):
        assert outputs[i] == alone[i], i
    for i in failed:  # asked again, served
        outputs[i], errors[i] = [], []
        engine.add(BatchRequest(emit=emitter(i), **reqs[i]))
    drain()
    assert not any(errors) and outputs == alone


def test_an_idle_engine_charges_no_step_its_idle_time(loaded, fake_clock):
    """A request that comes after the engine stood idle (a single user's next message): no
    step's observed time includes the wait (it would price speculation, or the guard's
    windows, by a pause of the user's)."""
    model, tok, draft, _ = loaded["llama"]
    engine = engine_for(model, with_eos(tok), {"draft-model": BatchDraftModel(draft)})
    seconds, observe = [], engine.policy.observe

    def record(rows, outcomes, spent, *args, **kwargs):
        seconds.append(spent)
        observe(rows, outcomes, spent, *args, **kwargs)

    engine.policy.observe = record
    always_draft(engine, 0)
    requests = busy_requests(scored_vocab(model, tok), "draft-model", "auto", n=2)
    run_all(engine, requests[:1])
    fake_clock.advance(0.3)  # the server idle between requests
    run_all(engine, requests[1:])
    assert seconds and max(seconds) < 0.3


def test_steps_after_rows_join_or_leave_are_reported_disturbed(loaded):
    """The first step observed after rows joined or left the batch runs what that queued
    (the cache re-formed) whatever its K: it is reported `disturbed`, and the steps of a
    batch that kept its rows are not."""
    model, tok, _, _ = loaded["llama"]
    engine = engine_for(model, with_eos(tok), {"ngram": BatchNgram()}, max_batch=3)
    events, observe = [], engine.policy.observe

    def record(rows, outcomes, seconds, *args, disturbed=False, **kwargs):
        events.append((len(rows), disturbed))
        observe(rows, outcomes, seconds, *args, disturbed=disturbed, **kwargs)

    engine.policy.observe = record
    always_draft(engine, 0)
    requests = busy_requests(scored_vocab(model, tok), "ngram", "auto", n=7)
    run_all(engine, requests)
    disturbed = [i for i, (_, d) in enumerate(events) if d]
    # rows came and went: some steps disturbed, most not; every change of the batch's size
    # between two steps observed in a row is a disturbed step
    assert 3 <= len(disturbed) < len(events) / 2, events
    for (size, _), (after, hit) in zip(events, events[1:], strict=False):
        if after != size:
            assert hit, events


def test_a_switch_out_of_plain_decoding_is_priced_apart_from_the_width():
    """On an H100 at 8 rows the first speculative step after plain ones took up to 5 ms more
    than the next ones (5 ms for 2.5x a plain step's tokens, a plain step 3 ms). A switch
    step's excess goes apart (`StepCosts.switch`, learnt near the 5 ms it costs), paid once per
    run of speculative steps; the step after a probe prices its width, and the batch
    drafts."""
    policy, rng = BatchDraftPolicy(["ngram"], guard=False), random.Random(0)
    ks = []
    for _ in range(400):
        choice = policy.choose([RowAsk([0], None, 8, [None]) for _ in range(8)])
        outcomes = outcomes_of(choice.rows, rng, 0.85)
        seconds = 3e-3 if not choice.num_draft else 4.5e-3 + 0.2e-3 * choice.num_draft
        if choice.num_draft and (not ks or not ks[-1]):
            seconds += 5e-3
        ks.append(choice.num_draft)
        policy.observe(choice.rows, outcomes, seconds, window=choice.window)
    assert sum(k > 0 for k in ks[-200:]) >= 180
    assert 3e-3 < policy.costs.switch[(0,)] < 6e-3


def test_a_shapes_first_step_that_built_its_kernels_prices_nothing():
    """MLX builds a GPU's kernels at their first use: the first speculative step of a shape
    cost 17 ms on an H100 where the next ones cost 4.5. Set aside (over twice its price), it
    neither prices its width nor the switch; the next step of the shape does, and a
    shape's first step at its price counts."""
    from mlx_spec.decoding.step_costs import StepCosts

    costs = StepCosts()
    for _ in range(5):
        costs.observe(8, 0, (), 3e-3)
    costs.observe(8, 1, (0,), 20e-3)  # a switch, and the first (8, 1): set aside
    assert (0,) not in costs.switch and ((0,), 8, 1) not in costs.cells
    costs.observe(8, 1, (0,), 4.5e-3)  # its follow-up prices the width
    assert costs.seconds(8, 1, (0,)) < 5e-3
    costs.observe(8, 0, (), 3e-3)
    costs.observe(8, 1, (0,), 5.5e-3)  # a later switch: kept
    assert costs.switch[(0,)] == pytest.approx(5.5e-3 - 4.5e-3, rel=0.3)
    costs.observe(8, 2, (0,), 5e-3)  # a first step at its price counts
    assert ((0,), 8, 2) in costs.cells


def test_turnover_is_taken_off_the_steps_that_carried_it():
    """Rows joining or leaving make the next step dearer whatever its K: plain steps that
    carried it teach its cost (their own average untouched), and a speculative step that
    carried it is priced without it; a switch step's excess goes apart from its width."""
    from mlx_spec.decoding.step_costs import StepCosts

    costs = StepCosts()
    for _ in range(5):
        costs.observe(8, 0, (), 3e-3)
    costs.observe(8, 0, (), 13e-3, disturbed=True)
    assert costs.plain[8] == pytest.approx(3e-3) and costs.turnover[8] == pytest.approx(10e-3)
    costs.observe(8, 2, (0,), 3e-3 + 6e-3)  # the switch: 1 ms over the prior's price
    assert costs.switch[(0,)] > 0 and (((0,), 8, 2)) not in costs.cells
    for _ in range(30):
        costs.observe(8, 2, (0,), 4.5e-3)
    costs.observe(8, 2, (0,), 14.5e-3, disturbed=True)
    assert costs.seconds(8, 2, (0,)) == pytest.approx(4.5e-3, rel=0.02)  # no switch now
    costs.observe(8, 0, (), 3e-3)
    switching = costs.seconds(8, 2, (0,))
    assert switching == pytest.approx(4.5e-3 + costs.switch[(0,)] / costs.horizon, rel=0.02)


def test_batchable_families(loaded):
    """Attention caches batch; recurrent state (qwen3_5's gated delta-net) does not."""
    assert batchable(loaded["llama"][0]) and batchable(loaded["gemma3"][0])
    assert not batchable(loaded["qwen3_5"][0])


def test_batch_costs_keep_catch_up_apart():
    """Steps whose drafters first catch up on what piled up over plain steps: the fit puts
    that cost on the catch-up tokens, not on the fixed part every speculative step pays."""
    from mlx_spec.decoding.step_costs import StepCosts

    costs, rng = StepCosts(), random.Random(0)
    for _ in range(20):
        costs.observe(8, 0, (), 4e-3)
    for _ in range(200):
        big_k, rows = rng.randint(1, 6), rng.choice([4, 8])
        catch_up = rng.choice([0, 0, 0, rows * rng.randint(1, 40)])
        seconds = 4e-3 + 0.5e-3 + big_k * (0.3e-3 + 0.1e-3 * rows) + 0.05e-3 * catch_up
        costs.observe(rows, big_k, (0,), seconds, catch_up)
    c0, c1, c2, c3 = costs.weights((0,))
    # c0 stays near its 0.5 ms (the prior pulls it a little), not the ~1.5 ms mean catch-up
    assert 0.25e-3 < c0 < 0.7e-3 and abs(c3 - 0.05e-3) < 0.01e-3
    assert costs.seconds(8, 2, (0,)) < costs.seconds(8, 2, (0,), catch_up=100)


def test_catch_up_counts_what_a_step_feeds_beyond_its_own():
    """W: per drafter, its drafting rows times how far the longest backlog exceeds K."""
    asks = [RowAsk([0], None, 8, [None], [b]) for b in (0, 2, 30)] + [RowAsk([], None, 8, [])]
    assert BatchDraftPolicy.catch_up(asks, [(0, 3), (0, 3), (0, 3), (None, 0)]) == 3 * 27
    assert BatchDraftPolicy.catch_up(asks, [(0, 3), (0, 3), (None, 0), (None, 0)]) == 0


def test_a_chained_drafters_passes_bound_what_an_unmeasured_width_may_cost():
    """A lone row on an H100 (MTP head): a plain step 2.6 ms, a speculative one 1 ms more
    and 2 ms per draft (one head pass each), half the drafts kept. A width never run was
    hoped to cost a plain step: exploring steps ran K = 8 at 19 ms. With the drafts'
    measured passes in the bound (`chained`), no width beyond what its passes allow is
    explored, and the row loses less to its probes (0.96x of plain decoding over 400 steps,
    cold start included, against 0.945x)."""

    def run(chained):
        policy, rng = BatchDraftPolicy(["mtp"], chained=chained), random.Random(0)
        ks, seconds, tokens = [], 0.0, 0
        for _ in range(400):
            choice = policy.choose([RowAsk([0], None, 8, [None], [0])])
            k = choice.num_draft
            outcomes = outcomes_of(choice.rows, rng, 0.5)
            step = 2.6e-3 + (1e-3 + 2e-3 * k if k else 0.0)
            ks.append(k)
            seconds, tokens = seconds + step, tokens + 1 + outcomes[0][1]
            policy.observe(choice.rows, outcomes, step, window=choice.window, drafting=2e-3 * k)
        return ks, tokens / seconds

    unbounded, unbounded_rate = run(())
    bounded, bounded_rate = run((0,))
    assert sum(k >= 5 for k in unbounded) >= 2, unbounded  # the hope explored wide widths
    assert not any(k >= 5 for k in bounded), bounded
    assert bounded_rate > unbounded_rate
    assert bounded_rate > 0.955 / 2.6e-3  # probes and the cold start cost under 5%


def test_a_catch_up_is_spread_over_the_steps_it_served():
    """A model drafter that sat out must first feed what it missed (a catch-up), priced
    spread over the steps it is expected to go on drafting. In a group at 8 rows on a 2-core
    x86 the MTP head drafted far fewer than the 8 assumed after most catch-ups: the policy
    learns that from the steps it observes (per set of drafters that catch up), and prices
    a plan with a catch-up accordingly; drafters that never caught up keep the prior."""
    policy = BatchDraftPolicy(["ngram", "mtp"], alone=(1,), chained=(1,))
    for _ in range(5):
        policy.observe([(None, 0)] * 8, [(0, 0)] * 8, 10e-3)
    assert policy._horizon((1,)) == policy.horizon
    before = policy._rate([RowAsk([1], None, 8, [None], [40])] * 8, [(1, 2)] * 8, 20.0)
    for _ in range(12):  # a catch-up, one more step with the head, then the lookup alone
        policy.observe([(1, 2)] * 8, [(2, 1)] * 8, 30e-3, catch_up=40)
        policy.observe([(1, 2)] * 8, [(2, 1)] * 8, 20e-3)
        for _ in range(3):
            policy.observe([(0, 2)] * 8, [(2, 1)] * 8, 15e-3)
    assert 2.0 <= policy._horizon((1,)) < 3.5
    assert policy._horizon((0, 1)) == policy._horizon((1,))  # the lookup piles up no backlog
    assert policy._horizon((0,)) == policy.horizon
    after = policy._rate([RowAsk([1], None, 8, [None], [40])] * 8, [(1, 2)] * 8, 20.0)
    assert after < before  # the same catch-up, spread over fewer steps


def test_a_catch_up_is_spread_over_no_more_steps_than_its_rows_have_left():
    """A row near the end of its budget cannot repay a catch-up over the horizon's steps: a
    plan whose rows must catch up spreads the catch-up over the steps they have left at the
    plan's tokens a row (`_serves`), and is priced dearer for rows about to end; rows with
    nothing to catch up beyond the step's own drafts keep the horizon."""
    policy = BatchDraftPolicy(["ngram", "mtp"], alone=(1,), chained=(1,))
    for _ in range(5):
        policy.observe([(None, 0)] * 4, [(0, 0)] * 4, 10e-3)
    rows = [(1, 2)] * 4
    shape = policy.shape(rows)
    horizon = policy._horizon((1,))

    def asks(backlog, left):
        return [RowAsk([0, 1], None, 8, [None, None], [0, backlog], left=left)] * 4

    assert policy._serves(asks(40, 60), rows, shape, 10.0) == horizon
    assert policy._serves(asks(40, 5), rows, shape, 10.0) == 2.0  # 5 tokens at 2.5 a step
    assert policy._serves(asks(40, 1), rows, shape, 10.0) == 1.0  # at least the step itself
    assert policy._serves(asks(2, 5), rows, shape, 10.0) == horizon  # no catch-up beyond K
    lookup = [(0, 2)] * 4  # the lookup piles up no backlog
    assert policy._serves(asks(40, 5), lookup, policy.shape(lookup), 10.0) == horizon
    assert policy._rate(asks(40, 5), rows, 10.0) < policy._rate(asks(40, 60), rows, 10.0)


def test_exploring_steps_do_not_force_a_measured_drafter_that_must_catch_up():
    """A group of 8 rows: the n-gram lookup keeps 70% of its drafts, a draft model 30% and
    costs a pass per draft. Once the draft model's acceptance is measured, the plans leave
    it out, so it piles up a backlog; exploring steps that forced the least tried drafter
    of the group into the plan fed that backlog for every row every 16th speculative step
    (measuring nothing new). Now only a drafter with a guess for an acceptance, or one
    that drafts without catching up, is forced."""
    policy = BatchDraftPolicy(["draft", "ngram"], alone=(0,), chained=(0,), guard=False)
    rng = random.Random(4)
    backlog = [0] * 8
    forced, steps, whys = 0, 600, []
    for step in range(steps):
        asks = [RowAsk([0, 1], None, 8, [None, None], [b, 0]) for b in backlog]
        choice = policy.choose(asks)
        whys.append(choice.why if choice.num_draft else "plain")
        outcomes = []
        for arm, k in choice.rows:
            rate = 0.3 if arm == 0 else 0.7
            n = 0
            while arm is not None and n < k and rng.random() < rate:
                n += 1
            outcomes.append((k, n))
        big_k = choice.num_draft
        drafting = any(arm == 0 and k for arm, k in choice.rows)
        seconds = 1e-3 * (10 + big_k + (2 * big_k if drafting else 0) + 0.2 * choice.catch_up)
        policy.observe(
            choice.rows, outcomes, seconds, catch_up=choice.catch_up,
            drafting=2e-3 * big_k if drafting else 0.0,
        )  # fmt: skip
        for i, ((arm, k), (_, n)) in enumerate(zip(choice.rows, outcomes, strict=True)):
            backlog[i] = 0 if arm == 0 and k else backlog[i] + 1 + n
        if step >= steps - 400 and drafting and choice.catch_up:
            forced += 1
    assert policy.trials[0][0] >= policy.thin  # the draft model was measured
    assert forced <= 2, forced
    # Every `explore_every`-th speculative step explores (`BatchChoice.why`).
    speculative = [why for why in whys if why != "plain"]
    explored = speculative.count("explore")
    assert abs(explored - len(speculative) / policy.explore_every) <= 3, (explored, whys)
    assert set(speculative) <= {"best", "explore", "probe", "follow"}


def test_a_mixed_sets_hope_counts_its_chained_drafters_passes():
    """Only steps whose drafters are all chained measure their passes; a group's step where
    some rows draft with the MTP head (chained) and others with the lookup is bound by the
    head's own measured cost per draft, at the largest size measured up to its own."""
    from mlx_spec.decoding.step_costs import StepCosts

    costs = StepCosts()
    for _ in range(3):
        costs.observe(4, 0, (), 10e-3)
    costs.observe_drafting(4, 2, (0,), 4e-3)  # the head alone: 2 ms a draft at 4 rows
    assert costs.draft_seconds(4, (0, 1)) == pytest.approx(2e-3)
    assert costs.draft_seconds(6, (0, 1)) == pytest.approx(2e-3)
    assert costs.draft_seconds(2, (0, 1)) == 0.0  # never measured at 2 rows or fewer
    assert costs.hope(4, 6, (0, 1)) >= 10e-3 + 6 * 2e-3
    costs.observe_drafting(4, 1, (0, 1), 1e-3)  # the set's own measure stands where it has one
    assert costs.draft_seconds(4, (0, 1)) == pytest.approx(1e-3)


def test_a_rows_own_acceptance_sets_its_level_and_rows_alike_merge():
    """A row that kept few of its drafts is planned with less acceptance than the drafter's
    over all rows (and one that kept many with more), shrunk towards it while its counts
    are few; rows at the same level merge into one ask."""
    from mlx_spec.decoding.batch_plans import MergedAsks
    from mlx_spec.decoding.batch_policy import RowRecord

    policy = BatchDraftPolicy(["ngram"])
    for _ in range(30):  # the lookup keeps half its drafts over all rows
        policy.observe([(0, 2)] * 2, [(2, 2), (2, 0)], 1e-2)
    low, high, fresh, early = RowRecord(), RowRecord(), RowRecord(), RowRecord()
    for _ in range(10):
        low.drafted(0, 2, 0)
        high.drafted(0, 2, 2)
    early.drafted(0, 2, 0)
    asks = [r.ask([0], None, 8, [None], [0]) for r in (low, high, fresh, fresh, early)]
    policy._prepare(asks)
    levels = [a.levels[0] for a in asks]
    assert levels[0] < levels[4] < 0 == levels[2] == levels[3] < levels[1], levels
    gains = policy._gains()
    assert gains.of(0, levels[0])[2] < gains[0][2] < gains.of(0, levels[1])[2]
    assert len(MergedAsks(asks).distinct) == 4


def test_the_guard_judges_a_drafter_on_allowed_steps_that_drafted_with_it():
    """Allowed windows in which the policy drafted nothing with the drafter (a lone row's
    first windows, before its probes) weigh plain steps against plain steps and the joins
    charged to them: no verdict, and the drafter stays allowed but for a barred window now
    and then (a lone row's MTP head on a 2-core x86, 1.2x of plain decoding once drafting,
    was barred through a whole server run by two such windows). Once its allowed steps
    have drafted with it, the guard judges it as before: where they realise less, it is
    barred."""
    from mlx_spec.decoding.drafter_guard import DrafterGuard

    def windows(guard, count, allowed_seconds, drafted):
        barred = []
        for _ in range(count):
            for _step in range(guard.window):
                bar = guard.window_for(1, (0,))
                seconds = 0.010 if bar else allowed_seconds
                guard.observe(1, bar, 1, seconds, set() if bar else drafted)
            barred.append(bool(bar))
            if not bar:
                guard.charge(1, 0, 0.05)  # a request joined the drafter
        return barred

    guard = DrafterGuard()
    assert sum(windows(guard, 12, 0.010, set())) <= 4
    assert guard.ratio(1, 0) < 0.9 and guard.ratio(1, 0, drafted=True) is None
    assert sum(windows(guard, 12, 0.012, {0})) >= 8


def test_a_saved_drafter_state_is_taken_in_where_the_policy_drafts_with_it(loaded):
    """A model drafter's state that the prompt cache saved costs nothing to take in, but a
    group's row joined to the drafter costs the steps the policy weighs it in, its
    catch-ups and its probes (on a 2-core x86 the group at 8 rows, with a prompt cache kept
    across requests, joined every row to every model drafter it had a state of: 0.86x of
    plain decoding through the server, 0.90x judging those joins): a group's prompt asked
    again takes its saved state in where the policy drafts with the drafter at that size,
    and leaves it out where the policy has stopped (not taking it in late either, however
    cheap). A row whose only drafter it is takes its saved state in. Every answer equals
    plain decoding."""
    model, tok, draft, _ = loaded["llama"]
    tok = with_eos(tok)
    vocab = scored_vocab(model, tok)
    drafters = {"ngram": BatchNgram(), "draft-model": BatchDraftModel(draft)}
    engine = engine_for(model, tok, drafters, max_batch=2, row_cache=RowCache())
    policy, arm = engine.policy, 1
    policy.probe_join = 10**6  # no row joins to keep the drafter measured
    always_draft(engine, arm)
    rounds = []
    for drafter, drafts in [("all", True), ("all", True), ("draft-model", False), ("all", False)]:
        req = busy_requests(vocab, drafter, "auto")[2]  # 60 tokens
        plain = mlx_spec.generate(model, tok, req["prompt"], max_tokens=req["max_tokens"])
        if not drafts:
            for _ in range(100):  # a lone row that could draft with it: plain steps only
                policy.observe([(arm, 0)], [(0, 0)], 0.01)
        ((tokens, final),) = run_all(engine, [req])
        assert tokens == plain.tokens
        assert final.stats.cached_tokens or not rounds
        rounds.append(final.stats.drafter_rounds.get("draft-model", 0))
        assert not any(d.rows for d in drafters.values())
    first, saved, alone, stopped = rounds
    assert first > 0 and saved > 0 and alone > 0 and stopped == 0, rounds


def test_a_saved_state_is_judged_by_use_alone():
    """`join_pays` with `always_cheap` False (a saved state, a late join): at a size where
    the policy hardly drafted with the drafter, a join however cheap is turned away (every
    `probe_join`-th row still joins, to keep it measured); where it drafts with it, taken."""
    policy = BatchDraftPolicy(["mtp"], join_budget=0.03, probe_join=4)
    policy.observe_join(0, 100, 5.0)  # the first: compiling
    policy.observe_join(0, 100, 0.002)  # 20 us a token
    for _ in range(40):  # B = 4: never drafted
        policy.observe([(0, 0)] * 4, [(0, 0)] * 4, 0.01)
    assert policy.join_pays(0, 4, probe=False, tokens=8, life=64)  # cheap: taken
    assert not policy.join_pays(0, 4, probe=False, tokens=8, life=64, always_cheap=False)
    joined = [policy.join_pays(0, 4, tokens=8, life=64, always_cheap=False) for _ in range(8)]
    assert joined == [False, False, False, True] * 2
    for _ in range(40):  # now it drafts with it
        policy.observe([(0, 2)] * 4, [(2, 1)] * 4, 0.015)
    assert policy.join_pays(0, 4, probe=False, tokens=8, life=64, always_cheap=False)
