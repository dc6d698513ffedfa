"""BLAS threads per pass width: what is measured, what is set, and where the engine sets it."""

from __future__ import annotations

import ctypes

import mlx_spec.platform.blas_threads as bt
from mlx_spec.core.compat import scored_vocab
from mlx_spec.decoding.engine import BatchEngine
from mlx_spec.drafters.batch import BatchDraftModel
from mlx_spec.platform import blas
from mlx_spec.platform.blas_threads import MAX_WIDTH, BlasThreads

import mlx.nn as nn
import pytest
from helpers import busy_requests, run_all, with_eos


class Recorder:
    """A thread setter that records what it was asked to set."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


def test_use_sets_the_measured_count_only_when_it_changes():
    setter = Recorder()
    threads = BlasThreads({4: 1, 8: 1}, most=2, setter=setter)
    for tokens in (1, 8, 8, 4, 16, 300, 8):
        threads.use(tokens)
    assert setter.calls == [2, 1, 2, 1]  # 1 -> 2 (first: set); 8 -> 1; 16 -> 2; 8 -> 1
    threads.reset()
    assert setter.calls[-1] == 2


def test_shapes_are_the_mlp_pair_by_weight_mass():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(32, 32, bias=False)
            self.k = nn.Linear(32, 8, bias=False)
            self.up = nn.Linear(32, 96, bias=False)
            self.gate = nn.Linear(32, 96, bias=False)
            self.down = nn.Linear(96, 32, bias=False)

    model = nn.Sequential(Block(), Block())
    assert bt._shapes(model) == [(96, 32), (32, 96)]
    nn.quantize(model, group_size=32, bits=4)
    assert bt._shapes(model) == []  # quantized matmuls are MLX's own kernels: nothing to tune


def test_measure_keeps_one_thread_only_where_it_ran_faster(monkeypatch):
    """With a clock under the test's control, widths whose one-thread runs took less than
    MARGIN of the all-thread runs get one thread, the others none; every thread at the end."""
    setter = Recorder()
    now = [0.0]
    state = {"threads": 2}

    def set_threads(n):
        setter(n)
        state["threads"] = n

    def fake_eval(*arrays):
        width = arrays[0].shape[0] if arrays and hasattr(arrays[0], "shape") else 0
        slow_on_two = width in (4, 12)
        now[0] += 1.0 if state["threads"] == 1 else (2.0 if slow_on_two else 0.95)

    monkeypatch.setattr(bt.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(bt.mx, "eval", fake_eval)
    best = bt._measure([(16, 8), (8, 16)], 2, set_threads)
    assert best == {4: 1, 12: 1}
    assert setter.calls[-1] == 2


def test_measure_wants_one_thread_to_win_again_and_most_pairs(monkeypatch):
    """A width that one thread ran faster in the first round only (a noisy start), or by its
    median but not in most of the confirming pairs, keeps every thread; one that won both
    rounds and most pairs gets one."""
    now = [0.0]
    state = {"threads": 2}
    runs: dict[tuple[int, int], int] = {}  # (width, threads) -> runs so far

    def set_threads(n):
        state["threads"] = n

    def seconds(width: int, threads: int, run: int) -> float:
        first = run < bt.REPEATS
        if width == 2:  # one thread faster in the first round only
            return (0.5 if first else 1.5) if threads == 1 else 1.0
        if width == 3:  # faster by the median, but in 5 of the 9 confirming pairs only
            if threads == 1:
                return 0.5 if first or (run - bt.REPEATS) % 2 == 0 else 1.2
            return 1.0
        if width == 5:  # faster in both rounds, every pair
            return 0.6 if threads == 1 else 1.0
        return 1.0 if threads == 1 else 0.9

    def fake_eval(*arrays):
        if not arrays or not hasattr(arrays[0], "shape") or arrays[0].ndim != 2:
            return
        width, threads = arrays[0].shape[0], state["threads"]
        run = runs.get((width, threads), 0)
        runs[width, threads] = run + 1
        now[0] += seconds(width, threads, run)

    monkeypatch.setattr(bt.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(bt.mx, "eval", fake_eval)
    assert bt._measure([(16, 8), (8, 16)], 2, set_threads) == {5: 1}
    assert state["threads"] == 2
    assert runs[2, 1] == bt.REPEATS + bt.CONFIRM and runs[7, 1] == bt.REPEATS  # confirmed: picked


def test_calibrate_is_off_on_request_and_pins_a_count(monkeypatch):
    model = nn.Sequential(nn.Linear(16, 48, bias=False), nn.Linear(48, 16, bias=False))
    monkeypatch.setattr(bt, "_openblas", lambda: (2, Recorder()))
    monkeypatch.setenv(bt.ENV, "all")
    assert BlasThreads.calibrate(model) is None
    monkeypatch.setenv(bt.ENV, "1")
    pinned = BlasThreads.calibrate(model)
    pinned.use(5)
    pinned.use(500)
    assert pinned._set.calls == [1]  # every width: one thread


@pytest.mark.skipif(bt._openblas() is None, reason="MLX does not use OpenBLAS here")
def test_calibrate_measures_the_real_library_and_restores_it(monkeypatch):
    monkeypatch.delenv(bt.ENV, raising=False)
    most, setter = bt._openblas()
    get = ctypes.CDLL(blas.provider_of(b"cblas_sgemm")).openblas_get_num_threads
    model = nn.Sequential(nn.Linear(24, 64, bias=False), nn.Linear(64, 24, bias=False))
    threads = BlasThreads.calibrate(model)
    if most < 2:
        assert threads is None
        return
    assert set(threads.best.values()) <= {1} and set(threads.best) <= set(range(1, MAX_WIDTH + 1))
    assert get() == most
    threads.use(1_000)  # a long prompt: every thread, even after an engine left one set
    setter(1)
    assert BlasThreads.calibrate(model).most == most  # the library's own count, not the last set
    setter(most)
    assert BlasThreads.calibrate(model).best is threads.best  # measured once per process


def test_engine_sets_threads_for_each_pass_width(loaded):
    """Plain steps set the rows, prefill chunks rows x width, speculative steps rows x (1 + K);
    the outputs are those of a run without the plan."""
    model, tok, draft, _ = loaded["llama"]
    tok = with_eos(tok)
    widths: list[int] = []

    class Plan:
        def use(self, tokens):
            widths.append(tokens)

    def run(plan, drafter, num_draft):
        engine = BatchEngine(
            model, tok, scored_vocab(model, tok), {"draft-model": BatchDraftModel(draft)},
            max_batch=4, prefill_step=16,
        )  # fmt: skip
        engine.threads = plan
        return run_all(engine, busy_requests(scored_vocab(model, tok), drafter, num_draft, n=5))

    plain = run(Plan(), None, 0)
    assert 4 in widths and any(w > 4 for w in widths)  # four rows decoding; prefill chunks
    widths.clear()
    spec = run(Plan(), "draft-model", 3)
    assert 16 in widths  # four rows verifying three drafts each
    assert [t for t, _ in plain] == [t for t, _ in run(None, None, 0)]
    assert [t for t, _ in spec] == [t for t, _ in plain]
