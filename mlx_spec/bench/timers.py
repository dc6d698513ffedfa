"""The cost model's timers: drafters timed in situ and target passes timed alone."""

from __future__ import annotations

import time

from mlx_spec.bench.costs import median_or_zero
from mlx_spec.core.sampling import SamplingConfig, greedy, logits_to_probs, sample
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.decoding.tree import TreeDrafter
from mlx_spec.drafters.base import Draft, Drafter

import mlx.core as mx


class TimedDrafter(Drafter):
    """Wraps a drafter and times each `draft()` until its output is evaluated."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name = inner.name
        self.needs_hidden = inner.needs_hidden
        self.hidden_layers = getattr(inner, "hidden_layers", None)
        self.seconds = 0.0
        self.drafted = 0

    @property
    def runner(self):
        return getattr(self.inner, "runner", None)

    @property
    def arm_names(self) -> list[str]:
        return self.inner.arm_names

    def select(self, arm: int) -> None:
        self.inner.select(arm)

    def arms_available(self, k: int) -> list[int | None]:
        return self.inner.arms_available(k)

    def catch_up(self) -> None:
        self.inner.catch_up()

    def check_compatible(self, target, tokenizer, vocab_size: int) -> None:
        self.inner.check_compatible(target, tokenizer, vocab_size)

    def bind_target(self, target) -> None:
        self.inner.bind_target(target)

    def begin(self, prompt, vocab_size, hidden=None) -> None:
        self.inner.begin(prompt, vocab_size, hidden)

    def draft(self, k: int, sampling: SamplingConfig) -> Draft:
        tic = time.perf_counter()
        draft = self.inner.draft(k, sampling)
        mx.eval(draft.tokens, *([] if draft.probs is None else [draft.probs]))
        self.seconds += time.perf_counter() - tic
        self.drafted += draft.tokens.size
        return draft

    def accept(self, num_accepted, emitted, hidden=None) -> None:
        self.inner.accept(num_accepted, emitted, hidden)


class TimedTreeDrafter(TreeDrafter):
    """Wraps a tree drafter and times each `draft_tree()`; `drafted` counts levels."""

    def __init__(self, inner: TreeDrafter):
        self.inner = inner
        self.name, self.needs_hidden = inner.name, inner.needs_hidden
        self.hidden_layers = getattr(inner, "hidden_layers", None)
        self.max_depth = inner.max_depth
        self.seconds = 0.0
        self.drafted = 0
        self.nodes, self.rounds = 0, 0  # tokens of the trees' passes (root included), rounds

    def check_compatible(self, hidden_size: int, vocab_size: int) -> None:
        self.inner.check_compatible(hidden_size, vocab_size)

    def begin(self, prompt, hidden) -> None:
        self.inner.begin(prompt, hidden)

    def draft_tree(self, depth, vocab_size, sampling):
        tic = time.perf_counter()
        tree = self.inner.draft_tree(depth, vocab_size, sampling)
        if tree.probs is not None:
            mx.eval(tree.probs)
        self.seconds += time.perf_counter() - tic
        self.drafted += tree.depth
        self.nodes += 1 + len(tree)
        self.rounds += 1
        return tree

    def accept(self, tokens, hidden) -> None:
        self.inner.accept(tokens, hidden)

    def side_branch(self):
        side = self.inner.side_branch()
        self.nodes += 0 if side is None else len(side.tokens)
        return side

    def observe_side(self, best) -> None:
        self.inner.observe_side(best)


class PassTimer:
    """Times target passes over n tokens at a fixed cache length, with the sampling work of a
    temperature; the cache is rolled back after each pass.

    Args:
        model: the target.
        vocab_size: logits are cut to this many tokens.
        ids: tokens to fill the cache with (repeated up to `context`).
        context: cache length at which passes are timed.
        sizes: token counts per pass.
        temperatures: 0 times an argmax, others probabilities and a draw.
    """

    def __init__(self, model, vocab_size, ids, context, sizes, temperatures):
        self.runner = ModelRunner(model, vocab_size, rollback=True)
        seq = (list(ids) * (context // max(len(ids), 1) + 1))[:context]
        self.runner.prefill(seq)
        self.feed = mx.array((seq * 2)[: max(sizes)], mx.uint32)
        self.sizes, self.temperatures = list(sizes), list(temperatures)
        self.times = {t: {n: [] for n in self.sizes} for t in self.temperatures}
        self.sample(2, keep=False)  # warm-up

    def _once(self, n: int, temperature: float) -> float:
        self.runner.checkpoint(n, single_call=True)
        tic = time.perf_counter()
        logits = self.runner(self.feed[:n])
        if temperature == 0:
            out = greedy(logits)
        else:
            out = sample(logits_to_probs(logits, SamplingConfig(temperature=temperature)))
        mx.eval(out)
        seconds = time.perf_counter() - tic
        self.runner.rollback(0)
        return seconds

    def sample(self, repeats: int, keep: bool = True) -> None:
        """Time `repeats` passes of every size and temperature, interleaved."""
        for _ in range(repeats):
            for temperature in self.temperatures:
                for n in self.sizes:
                    seconds = self._once(n, temperature)
                    if keep:
                        self.times[temperature][n].append(seconds)

    def medians(self) -> dict[float, dict[int, float]]:
        """{temperature: {n: median seconds}}."""
        return {
            t: {n: median_or_zero(v) for n, v in by_n.items()} for t, by_n in self.times.items()
        }
