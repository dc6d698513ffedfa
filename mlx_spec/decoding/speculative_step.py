"""A speculative step: the drafters draft, one target pass verifies every row's drafts (exact
match when greedy, rejection sampling otherwise), each row's cache rolls back by its own amount,
and the rows' pace against plain decoding is kept."""

from __future__ import annotations

from mlx_spec.core import clock
from mlx_spec.core.batch_verify import (
    batch_probs,
    batch_verify,
    greedy_batch_verify,
    gumbel,
    row_uniforms,
)
from mlx_spec.decoding.rows import Row
from mlx_spec.decoding.step_trace import StepTrace
from mlx_spec.drafters.batch import DraftBlock

import mlx.core as mx


class SpeculativeStep:
    """A speculative step: drafting, one verifying pass, each row's outcome and rollback. A part of
    `BatchEngine` (its state: `BatchEngine.__init__`)."""

    def _speculative_step(self, rows: list[Row], choice) -> None:
        tic = clock.now()
        for row in rows:
            self._tell(row)
        self._threads(len(rows))  # the drafters' passes: a token per row, most of them
        tokens, probs, counts = self._draft(rows, choice.rows)
        k = 0 if tokens is None else tokens.shape[1]
        built = clock.now()
        if k:  # the drafters compute while the verifying pass is built
            mx.async_eval(tokens if probs is None else (tokens, probs))
        # Queueing returns with the drafting nearly done (few operations may stay pending):
        # the verifying pass's width sets the threads from here.
        self._threads(len(rows) * (1 + k))
        queued = clock.now()
        lengths = [1 + n for n in counts]
        x = mx.array([r.tokens[-1] for r in rows], mx.uint32)[:, None]  # [B, 1]
        if k:
            if self.sync is not None:  # every rank verifies rank 0's drafts
                tokens = self.sync.share_input(tokens)
            x = mx.concatenate([x, tokens], axis=1)  # [B, 1 + K], pads past each row's drafts
        self.cache.begin(lengths)
        logits = self.model(x, cache=self.cache.layers)[..., : self.vocab]  # [B, 1 + K, V]
        self.cache.end(lengths)
        hidden = self.features.now()
        accepted, nxt = self._verify(rows, tokens, probs, logits, counts)
        if self.sync is not None:  # rank 0's outcome, one collective for both
            both = self.sync.share(mx.stack([accepted.astype(mx.int32), nxt.astype(mx.int32)]))
            accepted, nxt = both[0], both[1]
        waited = clock.now()
        mx.eval(accepted, nxt, x)
        read = clock.now()
        accepted, nxt, fed = accepted.tolist(), nxt.tolist(), x.tolist()
        targets = self.cache.lengths
        outcomes = []
        for i, row in enumerate(rows):
            n = accepted[i]
            emitted = fed[i][1 : 1 + n] + [nxt[i]]
            rows_hidden = None if hidden is None else hidden[i, : n + 1]
            keep = self._emit(row, emitted, counts[i], n, rows_hidden)
            targets[i] += keep - (1 + counts[i])  # the pass fed last + drafts; keep `keep`
            outcomes.append((counts[i], min(n, keep - 1)))
            arm, asked = choice.rows[i]
            if arm is not None and asked > 0:
                row.record.drafted(arm, asked, outcomes[-1][1])
        self.cache.truncate(targets)
        self.cache.tidy()  # columns before rows' tokens, squeezed out once they are many
        # Timed like a plain step: from the last step settled (the choice, the rows' asks and
        # leaving are the step's too), prefill work and the drafters' joins apart (a join is
        # its row's cost: the policy hands it to the guard, not to the step costs).
        seconds = clock.now() - self._last_settle - self._prefill_spent
        catch_up, window, joined = choice.catch_up, choice.window, self._join_spent
        turnover, self._turnover = self._turnover, False
        self._pace(rows, outcomes, seconds, turnover)
        self.policy.observe(
            choice.rows,
            outcomes,
            seconds,
            catch_up,
            window,
            joined,
            disturbed=turnover,
            drafting=queued - tic if k else 0.0,
        )
        self._last_settle, self._prefill_spent, self._join_spent = clock.now(), 0.0, {}
        if self.trace is not None:
            stamps = [tic, built, queued, waited, read, self._last_settle]
            spans = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            tokens = sum(1 + n for _, n in outcomes)
            widths = self._widths()
            arms = sorted({arm for arm, asked in choice.rows if arm is not None and asked})
            drafters = "+".join(self.names[a] for a in arms)
            expected = choice.expected or (0.0, 0.0)
            self.trace.append(
                StepTrace(
                    len(rows),
                    k,
                    choice.catch_up,
                    tokens,
                    *spans,
                    *widths,
                    choice.why,
                    drafters,
                    choose=max(0.0, tic - self._last_decode),
                    expected_tokens=expected[0],
                    expected_seconds=expected[1],
                )
            )

    def _draft(self, rows: list[Row], plan):
        """The step's drafts: `[B, K]` ids, `[B, K, V]` distributions (None: every draft
        one-hot) and drafts per row, gathered from each drafter's block."""
        per_drafter: dict[int, dict[int, int]] = {}
        for row, (arm, k) in zip(rows, plan, strict=True):
            if arm is not None and k > 0:
                per_drafter.setdefault(arm, {})[row.id] = k
        configs = {r.id: r.request.sampling for r in rows}
        randoms = {r.id: r.random for r in rows}
        index = {r.id: i for i, r in enumerate(rows)}
        blocks, counts, self._arm_of = [], [0] * len(rows), {}
        for arm, ks in per_drafter.items():
            block = self.drafters[self.names[arm]].draft(ks, configs, randoms)
            if block is None:
                continue
            blocks.append(block)
            for row, n in zip(block.rows, block.counts, strict=True):
                if n:
                    counts[index[row]], self._arm_of[row] = n, arm
        k = max(counts)
        if not k:
            return None, None, counts
        line = [0] * len(rows)  # each row's line in the blocks stacked below a line of pads
        first = 1
        for block in blocks:
            for j, (row, n) in enumerate(zip(block.rows, block.counts, strict=True)):
                if n:
                    line[index[row]] = first + j
            first += len(block.rows)
        order = mx.array(line)
        pads = [mx.zeros((1, k), mx.uint32)]
        tokens = mx.concatenate(pads + [_widen(b.tokens.astype(mx.uint32), k) for b in blocks])
        probs = None
        if any(b.probs is not None for b in blocks):
            dists = [_widen(_dists(b, self.vocab), k) for b in blocks]
            probs = mx.concatenate([mx.zeros((1, k, self.vocab))] + dists)[order]
        return tokens[order], probs, counts

    def _verify(self, rows, tokens, probs, logits, counts):
        num = mx.array(counts, mx.int32)
        if tokens is None:
            tokens = mx.zeros((len(rows), 0), mx.uint32)
        if all(r.request.sampling.greedy for r in rows):
            return greedy_batch_verify(logits, tokens, num)
        k, vocab = tokens.shape[1], logits.shape[-1]
        target = batch_probs(logits, [r.request.sampling for r in rows])  # [B, K + 1, V]
        # Each row draws as many uniforms as it has drafts: its stream never depends on the
        # other rows.
        u = mx.stack([row_uniforms(r.random, n, k) for r, n in zip(rows, counts, strict=True)])
        noise = gumbel([r.random for r in rows], (vocab,))
        return batch_verify(target, probs, tokens, num, u, noise)

    def _pace(self, rows: list[Row], outcomes, seconds: float, turnover: bool) -> None:
        """Each row's ledger after a speculative step of `seconds` (`Row.lag`): what plain
        steps at this batch size would have taken for the tokens it got, against the step's
        time (rows joining or leaving before it cost a plain step as much: not counted)."""
        plain = self.policy.costs.plain_seconds(len(rows))
        if turnover:
            seconds -= self.policy.costs.turnover_seconds(len(rows))
        for row, (_, accepted) in zip(rows, outcomes, strict=True):
            row.lag += seconds - (1 + accepted) * plain
            row.paced += (1 + accepted) * plain


def _widen(a: mx.array, k: int) -> mx.array:
    """`[n, K_a, ...]` padded with zeros to `[n, k, ...]` along its second axis."""
    if a.shape[1] >= k:
        return a[:, :k]
    pad = mx.zeros((a.shape[0], k - a.shape[1], *a.shape[2:]), a.dtype)
    return mx.concatenate([a, pad], axis=1)


def _dists(block: DraftBlock, vocab: int) -> mx.array:
    """`[n, K, V]` distributions of a block's drafts (one-hot where it has none)."""
    if block.probs is not None:
        return block.probs[..., :vocab]
    return (mx.arange(vocab) == block.tokens[..., None]).astype(mx.float32)
