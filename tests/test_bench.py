"""`mlx-spec bench`: the records it writes, the cost model's formula, and its errors."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

from mlx_spec import cli
from mlx_spec.bench import harness as bench
from mlx_spec.core.stats import SpecStats

import numpy as np
import pytest
from helpers import cli_here

REQUIRED = {
    "mode",
    "num_draft",
    "temperature",
    "tokens_per_sec",
    "speedup",
    "acceptance_rate",
    "acceptance_by_position",
    "mean_accepted_length",
    "target_passes_per_token",
    "latency_p50_ms",
    "latency_p95_ms",
    "prefill_tokens_per_sec",
    "peak_memory_mb",
    "rollback_ms",
    "predicted_speedup",
    "realized_over_predicted",
}
MAX_TOKENS = 16


def stats_of(drafted: list[int], accepted: list[int], rounds: int, tokens: int) -> SpecStats:
    stats = SpecStats(num_draft=len(drafted), generated_tokens=tokens, target_passes=rounds)
    stats.drafted_per_position, stats.accepted_per_position = drafted, accepted
    return stats


def test_predicted_speedup_full_rounds():
    """Every round drafts k = 2: E = 1 + sum_i a_i/d_i and the bound is E / (k c + v_k)."""
    stats = stats_of([10, 10], [8, 5], rounds=10, tokens=23)
    assert bench.expected_tokens_per_round(stats) == pytest.approx(1 + 0.8 + 0.5)
    predicted = bench.predicted_speedup(stats, draft_cost=0.1, verify_cost={1: 1.1, 2: 1.2})
    assert predicted == pytest.approx(2.3 / (2 * 0.1 + 1.2))


def test_predicted_speedup_mixed_draft_lengths():
    """Rounds that draft fewer tokens (an n-gram miss) cost v_j + j c with their own share."""
    stats = stats_of([6, 4], [3, 1], rounds=10, tokens=14)  # 4 rounds drafted 0, 2 one, 4 two
    assert bench.draft_length_shares(stats) == pytest.approx({0: 0.4, 1: 0.2, 2: 0.4})
    c, v = 0.05, {0: 0.9, 1: 1.1, 2: 1.3}
    cost = 0.4 * 0.9 + 0.2 * (c + 1.1) + 0.4 * (2 * c + 1.3)
    assert bench.predicted_speedup(stats, c, v) == pytest.approx(1.4 / cost)


def test_stats_from_mlx_lm_flags():
    """Rounds end at each token not from the draft; the last round is cut by max_tokens."""
    flags = [True, True, False, True, False, False, True]
    stats = bench.stats_from_flags(flags, num_draft=2)
    assert stats.target_passes == 4 and stats.generated_tokens == 7
    assert stats.drafted_per_position == [4, 3]
    assert stats.accepted_per_position == [3, 1]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("abcabcab\n\nponmlk\n")
    return path


@pytest.fixture(scope="module")
def self_draft_report(checkpoints, prompts_file):
    """The target drafting for itself (acceptance 1 at greedy), every mode but MTP."""
    target = str(checkpoints["llama"][0])
    config = bench.BenchConfig(
        model=target,
        draft_model=target,
        prompts_file=str(prompts_file),
        max_tokens=MAX_TOKENS,
        num_draft=(1, 3),
        repeats=1,
        micro_repeats=2,
    )
    return bench.run_bench(config)


def test_report_records(self_draft_report):
    """One JSON record per configuration with every required field; plain is the baseline."""
    record = json.loads(self_draft_report.to_json())
    results = record["results"]
    assert {r["mode"] for r in results} == {"plain", "draft-model", "ngram", "all", "mlx-lm"}
    # two temperatures: plain + 2 modes x (2 k + auto) + the group (auto) + the peer x 2 k
    assert len(results) == 2 * (1 + 2 * 3 + 1 + 2)
    for r in results:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["tokens_per_sec"] > 0 and r["peak_memory_mb"] > 0
        assert r["generated_tokens"] == MAX_TOKENS * 2  # two prompts, EOS off
    for r in (r for r in results if r["mode"] == "plain"):
        assert r["speedup"] == 1.0 and r["acceptance_rate"] is None and r["num_draft"] == 0
    for r in (r for r in results if r["mode"] in ("draft-model", "mlx-lm")):
        assert r["predicted_speedup"] > 0 and (r["vs_mlx_lm"] or r["num_draft"] == "auto")
    auto = [r for r in results if r["num_draft"] == "auto"]
    assert {r["mode"] for r in auto} == {"draft-model", "ngram", "all"}
    for r in auto:  # k chosen, in rounds (0: plain steps); the group's rounds by drafter
        assert sum(r["k_histogram"].values()) >= r["target_passes"] - 2
        assert r["vs_best_fixed_k"] is not None or r["mode"] == "all"
    group = next(r for r in auto if r["mode"] == "all")
    assert set(group["drafter_rounds"]) <= {"draft-model", "ngram"}
    assert {"header", "costs", "summary"} <= set(record)
    assert record["header"]["max_tokens"] == MAX_TOKENS


def test_self_draft_accepts_everything(self_draft_report):
    """Greedy self-drafting accepts every draft, in mlx-spec and in mlx-lm, and every greedy
    configuration reproduces plain decoding's tokens."""
    for mode in ("draft-model", "mlx-lm"):
        for k in (1, 3):
            r = self_draft_report.result(mode, k, 0.0)
            assert r.acceptance_rate == pytest.approx(1.0)
            assert r.acceptance_by_position == pytest.approx([1.0] * k)
            assert r.matches_plain is True
    r = self_draft_report.result("draft-model", 3, 0.0)
    assert r.expected_tokens_per_round == pytest.approx(4.0, abs=0.3)  # the cut last rounds


def test_markdown_table(self_draft_report):
    """The terminal table has a header row and one row per configuration."""
    text = self_draft_report.to_markdown()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| mode | k | T | tok/s | speedup |")
    assert (
        sum(
            row.startswith(("| plain ", "| draft-model ", "| ngram ", "| all ", "| mlx-lm "))
            for row in rows
        )
        == 20
    )
    assert "auto, ngram T=0:" in text
    assert "BLAS" in text and "mlx-spec / mlx-lm" in text
    assert "Communication of the sharded target" not in text  # one process: no line
    sharded = copy.deepcopy(self_draft_report)
    sharded.header["sharded"] = "tensor parallel over 2 ranks"
    sharded.results[0].comm_ms_per_pass = 5.25
    text = sharded.to_markdown()
    assert "- sharded: tensor parallel over 2 ranks" in text
    assert f"ms per pass (priced collectives): {sharded.results[0].label} T=0 5.25" in text


def test_cli_quick(checkpoints, prompts_file, tmp_path):
    """`mlx-spec bench --quick` on tiny models prints the table and writes the JSON."""
    target, draft = map(str, checkpoints["llama"])
    out = tmp_path / "bench.json"
    args = ["bench", "--model", target, "--draft-model", draft, "--prompts", str(prompts_file)]
    args += ["--quick", "--temperatures", "0", "--max-tokens", "24", "--json", str(out)]
    proc = cli_here(*args)
    assert proc.returncode == 0, proc.stderr
    assert "| mode | k | T |" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert {(r["mode"], r["num_draft"]) for r in results} == {
        ("plain", 0),
        *((mode, k) for mode in ("draft-model", "ngram", "mlx-lm") for k in (2, 4)),
        *((mode, "auto") for mode in ("draft-model", "ngram", "all")),
    }
    assert all(REQUIRED <= set(r) for r in results)
    assert all(r["k_histogram"] for r in results if r["num_draft"] == "auto")


def one_line_error(capsys, *args: str) -> str:
    """Run `mlx-spec ARGS` in process; assert exit code 2 and a single error line."""
    assert cli.main(list(args)) == 2
    lines = [
        line
        for line in capsys.readouterr().err.splitlines()
        if not line.startswith("mlx-spec: warning:")
    ]
    assert len(lines) == 1 and lines[0].startswith("mlx-spec: error:"), lines
    return lines[0]


@pytest.mark.parametrize(
    "case, text, message",
    [
        ("missing", None, "no such prompts file"),
        ("empty", "\n  \n", "no prompts"),
        ("bad-json", '{"prompt": "ab"}\n{"text": "cd"}\n', ':2: expected an object'),
        ("too-long", "ab" * 400 + "\n", "does not fit the context"),
    ],
)  # fmt: skip
def test_bad_prompts_file(checkpoints, tmp_path, capsys, case, text, message):
    path = tmp_path / "prompts.txt"
    if text is not None:
        path.write_text(text)
    target = str(checkpoints["llama"][0])
    line = one_line_error(capsys, "bench", "--model", target, "--prompts", str(path))
    assert message in line


@pytest.mark.parametrize(
    "flag, value",
    [("--num-draft", "0"), ("--num-draft", "2,x"), ("--temperatures", "-1"), ("--modes", "beam")],
)
def test_bad_lists(checkpoints, capsys, flag, value):
    target = str(checkpoints["llama"][0])
    assert flag in one_line_error(capsys, "bench", "--model", target, flag, value)


def test_draft_modes_need_a_draft_model(checkpoints, prompts_file, capsys):
    target = str(checkpoints["llama"][0])
    line = one_line_error(
        capsys, "bench", "--model", target, "--prompts", str(prompts_file), "--modes", "mlx-lm"
    )
    assert "--draft-model" in line


def test_mtp_drafter_found_beside_the_target(tmp_path, prompts_file):
    """A converted checkpoint with an MTP head gets the mtp mode without flags; its drafter is
    timed for the cost model and greedy output equals plain decoding."""
    from convert import convert_checkpoint

    import hfmodels as hfm

    source, _ = hfm.write_mimo_checkpoint(tmp_path / "mimo", seed=6)
    hfm.add_mtp(source, family="mimo", seed=50)
    target = convert_checkpoint(str(source), str(tmp_path / "mimo-mlx"), dtype="float32").path
    config = bench.BenchConfig(
        model=str(target),
        prompts_file=str(prompts_file),
        max_tokens=MAX_TOKENS,
        num_draft=(2,),
        temperatures=(0.0,),
        repeats=1,
        micro_repeats=2,
    )
    report = bench.run_bench(config)
    assert [r.mode for r in report.results] == ["plain", "ngram", "ngram", "mtp", "mtp", "all"]
    mtp = report.result("mtp", 2, 0.0)
    assert mtp.matches_plain and mtp.draft_cost > 0 and mtp.predicted_speedup > 0
    assert report.header["mtp"].endswith("mtp")


def test_round_breakdown_script(checkpoints, tmp_path, capsys):
    """benchmarks/round_breakdown.py on a tiny pair: one row per drafter and temperature, the
    phases and the unaccounted rest adding up to the profiled round."""
    target, draft = map(str, checkpoints["llama"])
    out = tmp_path / "rounds.json"
    args = ["--model", target, "--draft-model", draft, "--quick", "--num-prompts", "1"]
    assert (
        _benchmark("round_breakdown").main([*args, "--max-tokens", "24", "--json", str(out)]) == 0
    )
    assert "| drafter | k | T |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert {(r["drafter"], r["k"]) for r in rows} == {("draft-model", 1), ("draft-model", 2),
                                                       ("ngram", 4)}  # fmt: skip
    for r in rows:
        total = sum(r["phases_ms"].values())
        assert total == pytest.approx(r["profiled_ms_per_round"], rel=1e-6)
        assert r["phases_ms"]["target pass + verification"] > 0


def _benchmark(name: str):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _server_load():
    return _benchmark("server_load")


def test_server_load_budgets_and_steady_tokens():
    """benchmarks/server_load.py: `--vary-tokens` draws the same budgets for every mode at an
    N (within LO..HI, not all equal); the steady throughput counts a request's tokens by the
    share of its text events streamed before the first client was done."""
    load = _server_load()
    assert load.token_budgets(4, 3, None) is None
    budgets = load.token_budgets(8, 4, [16, 112])
    assert budgets == load.token_budgets(8, 4, [16, 112])
    assert len(budgets) == 8 and all(len(b) == 4 for b in budgets)
    flat = [n for b in budgets for n in b]
    assert all(16 <= n <= 112 for n in flat) and len(set(flat)) > 1
    done = [
        {"tokens": 10, "stamps": [1.0, 2.0]},  # all in before 2.5
        {"tokens": 12, "stamps": [2.0, 3.0, 4.0]},  # a third of its events before 2.5
        {"tokens": 5, "stamps": []},  # no text event: nothing counted
    ]
    assert load._tokens_before(done, 2.5) == pytest.approx(10 + 4)
    assert load._tokens_before(done, 0.5) == 0


def test_server_load_runs_plain_decoding_twice_for_the_noise_floor():
    """benchmarks/server_load.py: beside speculative modes, plain decoding runs a second time
    (`none-again`, the same requests), whose per-request comparison with `none` is the noise
    the speculative modes' are read against; not with plain decoding alone, nor when asked
    not to."""
    load = _server_load()
    body = {"max_tokens": 8}
    configs = load.mode_configs(["none", "ngram"], "u", body)
    assert [c[0] for c in configs] == ["none", "ngram", "none-again"]
    assert configs[2][2] == configs[0][2] == {**body, "speculative": {"enabled": False}}
    assert configs[1][2]["speculative"] == {"drafter": "ngram", "enabled": True}
    assert [c[0] for c in load.mode_configs(["none"], "u", body)] == ["none"]
    assert [c[0] for c in load.mode_configs(["none", "all"], "u", body, False)] == ["none", "all"]


def test_server_load_pairs_each_repeat_with_its_plain_runs():
    """benchmarks/server_load.py: a mode's throughput over the mean of the same repeat's
    plain runs (`none`, `none-again`), averaged over the repeats with its standard error."""
    load = _server_load()

    def rows(*rates):
        return [{"throughput_tokens_per_sec": r} for r in rates]

    out = load.paired_throughput(rows(90.0, 120.0), [rows(100.0, 110.0), rows(80.0, 130.0)])
    assert out["throughput_vs_plain_paired"] == pytest.approx(1.0)  # 90 / 90, 120 / 120
    assert out["paired_se"] == pytest.approx(0.0)
    out = load.paired_throughput(rows(90.0, 132.0), [rows(100.0, 120.0)])
    ratios = [0.9, 1.1]
    assert out["throughput_vs_plain_paired"] == pytest.approx(1.0)
    assert out["paired_se"] == pytest.approx(np.std(ratios, ddof=1) / np.sqrt(2))
    assert load.paired_throughput(rows(90.0), [rows(0.0)]) == {}


def test_server_load_compares_each_request_with_plain_decoding():
    """benchmarks/server_load.py: each request's latency over the same request's with
    speculation off in the same repeat (the same client and place), pooled over the repeats,
    failed requests left out; the share more than 5% slower and the ratio's p50 / p95, in
    the printed row and the markdown table."""
    load = _server_load()
    plain = [
        {"request_latencies": [[1.0, 1.0], [2.0, 2.0]]},
        {"request_latencies": [[1.0, 1.0], [1.0, None]]},
    ]
    spec = [
        {"request_latencies": [[0.5, 1.2], [2.0, None]]},  # 0.5, 1.2, 1.0
        {"request_latencies": [[1.04, 0.8], [3.0, 1.0]]},  # 1.04, 0.8, 3.0 (and one unpaired)
    ]
    out = load.versus_plain(spec, plain)
    assert out["slower_than_plain"] == pytest.approx(2 / 6)
    assert out["plain_ratio_p50"] == pytest.approx(1.02)
    assert out["plain_ratio_p95"] == pytest.approx(
        np.percentile([0.5, 0.8, 1.0, 1.04, 1.2, 3.0], 95)
    )
    assert (
        load.versus_plain([{"request_latencies": [[None]]}], [{"request_latencies": [[1.0]]}]) == {}
    )
    row = {
        "mode": "ngram", "concurrency": 8, "requests": 6, "completion_tokens": 64,
        "throughput_tokens_per_sec": 100.0, "per_stream_tokens_per_sec": 20.0,
        "latency_p50_s": 1.0, "latency_p95_s": 2.0, "ttft_p50_ms": 10.0, "ttft_p95_ms": 20.0,
        "acceptance_rate": 0.5, "errors": 0, **out,
    }  # fmt: skip
    assert "33% slower" in load._format(row)
    assert "| 33% (" in load.summary({"results": [row]})


def test_batch_engine_trace_splits_the_wall_time_and_the_reasons(capsys):
    """benchmarks/batch_engine.py `--trace`: the wall time's shares (plain, speculative and
    catch-up steps, the rest) and the speculative steps' by the policy's reason, each with
    the share of them that caught up, as printed and as kept in the JSON record."""
    from mlx_spec.decoding.engine import StepTrace

    trace = [
        StepTrace(8, 0, 0, 8, 0.0, 0.0, 0.0, 0.010, 0.0),  # a plain step: 10 ms
        StepTrace(8, 2, 0, 16, 0.001, 0.001, 0.001, 0.010, 0.001, why="best"),  # 14 ms
        StepTrace(8, 3, 12, 12, 0.002, 0.003, 0.001, 0.011, 0.002, why="explore", choose=0.001),
    ]  # the last: 20 ms, its choice among them
    out = _benchmark("batch_engine").print_trace(trace, wall=0.050)
    shares = out["wall_shares"]
    assert shares["plain"] == pytest.approx(0.2)
    assert shares["speculative"] == pytest.approx(0.28)
    assert shares["catch-up"] == pytest.approx(0.4)
    assert shares["other"] == pytest.approx(0.12)
    reasons = out["speculative_by_reason"]
    assert set(reasons) == {"best", "explore"}
    assert reasons["best"]["share"] == pytest.approx(0.28)
    assert reasons["best"]["tokens_per_sec"] == pytest.approx(16 / 0.014)
    assert reasons["best"]["catching_up"] == 0
    assert reasons["explore"]["catching_up"] == pytest.approx(0.4)
    printed = capsys.readouterr().out
    assert "explore  40%" in printed and "catching up  40%" in printed


def test_pass_width_shrinks_the_architecture_to_time_its_overhead(tmp_path):
    """benchmarks/pass_width.py --overhead: the model's architecture (its layers, heads,
    vocabulary, cache) with 8 dimensions a head and an MLP of 16, random float32 weights,
    runs the same batched passes as the model (what a pass costs whatever its weights)."""
    from mlx_spec.caches.batch import BatchCache

    import mlx.core as mx
    import tinymodels as tm
    from mlx.utils import tree_flatten

    config = tm.llama_config(tm.tokenizer_size(), num_hidden_layers=3, head_dim=8)
    tm.write_checkpoint(tmp_path, config, tm.random_weights(config, seed=0))
    small = _benchmark("pass_width").shrunk(str(tmp_path))
    assert len(small.layers) == 3 and small.args.hidden_size == 8 * 4
    assert small.args.intermediate_size == 16 and small.args.vocab_size == tm.tokenizer_size()
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(small.parameters()))
    cache = BatchCache(small, 2)
    cache.begin([3, 3])
    logits = small(mx.zeros((2, 3), mx.uint32), cache=cache.layers)
    cache.end([3, 3])
    assert logits.shape == (2, 3, tm.tokenizer_size())


def test_batch_engine_times_the_engines_parts_per_run(capsys):
    """benchmarks/batch_engine.py `--time-parts`: each of the engine's `PARTS` wrapped on the
    instance, its calls' wall time summed until taken (a run's), what the method returns
    passed through, and the policy's choices counted; the mean milliseconds and choices a
    run printed and kept."""
    import time as clock
    from types import SimpleNamespace

    bench = _benchmark("batch_engine")

    class Engine:
        def __init__(self):
            self.calls = []
            self.policy = SimpleNamespace(choose=lambda asks: len(asks))

        def __getattr__(self, name):  # every part: sleeps 2 ms, returns its name
            if name not in bench.PARTS:
                raise AttributeError(name)

            def part(*args):
                self.calls.append(name)
                clock.sleep(0.002)
                return name

            return part

    engine = Engine()
    timer = bench.PartTimer(engine)
    assert engine._settle(1) == "_settle" and engine._remove() == "_remove"
    engine._settle(2)
    assert engine.policy.choose([1, 2]) == 2 and engine.policy.choose([]) == 0
    first = timer.take()
    assert first["_settle"] >= 0.004 and first["_remove"] >= 0.002 and first["_launch"] == 0
    assert first["choices"] == 2
    assert engine.calls == ["_settle", "_remove", "_settle"]
    engine._launch()
    second = timer.take()
    assert second["_settle"] == 0 and second["_launch"] >= 0.002 and second["choices"] == 0
    means = bench.print_parts([first, second], wall=0.1)
    assert means["_settle"] == pytest.approx(1e3 * first["_settle"] / 2)
    assert means["choices"] == 1
    printed = capsys.readouterr().out
    assert "wall 50," in printed and "settle " in printed and "launch " in printed
    assert "1.0 choices" in printed
