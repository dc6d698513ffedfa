"""The draft-length policy on its own: fed synthetic rounds with known acceptance and costs, it
settles where the cost model says it should, within a bounded number of rounds."""

from __future__ import annotations

import random

from mlx_spec.decoding.policy import AdaptiveDraftLength, Choice, FixedDraftLength

import pytest

PLAIN = 0.010  # seconds per plain step


def verify_cost(drafts: int, slope: float = 0.1) -> float:
    """A target pass over drafts + 1 tokens: a plain step plus `slope` of one per extra token."""
    return PLAIN * (1.05 + slope * drafts)


def simulate(
    policy,
    accept_prob,
    draft_cost,
    rounds: int,
    seed: int = 0,
    slope: float = 0.1,
    held: dict[int, float] | None = None,
):
    """Drive `policy` for `rounds` choices; arm a's drafts are each kept with probability
    `accept_prob[a]` and cost `draft_cost[a]` seconds. `held`: choice index -> plain steps
    by which that choice's timing is held up (a busy machine's scheduler taking the core
    away). Returns the choices made."""
    rng = random.Random(seed)
    choices = []
    for i in range(rounds):
        choice = policy.choose(limit=64)
        choices.append(choice)
        extra = (held or {}).get(i, 0.0) * PLAIN
        if choice.plain_tokens:
            policy.observe_plain(choice.plain_tokens, choice.plain_tokens * PLAIN + extra)
            continue
        k, arm = choice.num_draft, choice.arm
        accepted = 0
        while accepted < k and rng.random() < accept_prob[arm]:
            accepted += 1
        seconds = k * draft_cost[arm] + verify_cost(k, slope) + extra
        policy.observe_round(arm, k, k, accepted, seconds)
    return choices


def test_fixed_draft_length_is_exactly_k():
    policy = FixedDraftLength(4)
    assert policy.choose(10) == Choice(0, 4)
    assert policy.choose(2) == Choice(0, 2)  # the output budget caps it
    assert policy.choose(0) == Choice(0, 0)


def test_first_choice_measures_plain_decoding():
    assert AdaptiveDraftLength(8).choose(8).plain_tokens > 0


def test_always_right_cheap_drafter_settles_on_k_max():
    """A drafter that is always right and costs 2% of a plain step: k = K within 30 choices,
    and K from then on (but for the periodic plain-step measurement and a neighbour explored
    every `explore_every` rounds)."""
    policy = AdaptiveDraftLength(8)
    choices = simulate(policy, [1.0], [0.02 * PLAIN], rounds=120)
    first = next(i for i, c in enumerate(choices) if c.num_draft == 8)
    assert first < 30
    later = [c.num_draft for c in choices[first:] if not c.plain_tokens]
    assert set(later) <= {7, 8} and later.count(7) <= len(later) / policy.explore_every + 1
    plain = sum(c.plain_tokens for c in choices[first:])
    assert plain <= 2 * policy.first_plain  # refreshes only


def test_a_held_up_plain_timing_is_taken_again():
    """The first plain stretch is held up (its 4 steps take 20: the thread was preempted, as on
    a busy machine with steps this short): an always-right cheap drafter still reaches K
    within a few rounds, and the plain step is timed again once a round shows it too long."""
    policy = AdaptiveDraftLength(6)
    choices = simulate(policy, [1.0], [0.02 * PLAIN], rounds=40, held={0: 16})
    assert [c.num_draft for c in choices[-20:]].count(6) >= 16
    assert policy.plain == pytest.approx(PLAIN)


def test_a_held_up_round_does_not_put_off_probes_for_long():
    """The first rounds are held up by 12 plain steps each, the rest run clean: the next
    probes come within `probe_max` steps, and an always-right drafter is back at K."""
    policy = AdaptiveDraftLength(6)
    choices = simulate(policy, [1.0], [0.02 * PLAIN], rounds=40, held={1: 12, 3: 12})
    assert max(c.plain_tokens for c in choices) <= policy.probe_max
    assert [c.num_draft for c in choices[-10:]].count(6) >= 8


def test_held_up_rounds_do_not_ratchet_the_round_time_up():
    """Held-up rounds in a row (each 8 plain steps late) move the predicted round time by a
    fraction of what they would as plain samples; clean rounds bring it back."""
    policy = AdaptiveDraftLength(6)
    simulate(policy, [1.0], [0.02 * PLAIN], rounds=40)
    clean = policy.round_seconds(0, 6)
    truth = 6 * 0.02 * PLAIN + verify_cost(6)
    assert clean == pytest.approx(truth, rel=0.05)
    for _ in range(4):
        policy.observe_round(0, 6, 6, 6, truth + 8 * PLAIN)
    assert policy.round_seconds(0, 6) < 1.3 * truth
    assert policy.choose(64).num_draft >= 5


def test_a_cost_that_rose_is_learnt():
    """Rounds that take three times their cost every time from some point on (a drafter
    slower on this text, a busier machine) are no held-up outliers: from the third in a row
    they count in full, and within 10 rounds the predicted round time is well on its way."""
    policy = AdaptiveDraftLength(6)
    simulate(policy, [1.0], [0.02 * PLAIN], rounds=40)
    truth = 6 * 0.02 * PLAIN + verify_cost(6)
    for _ in range(10):
        policy.observe_round(0, 6, 6, 6, 3 * truth)
    assert policy.round_seconds(0, 6) > 1.4 * truth  # counted as held up: 1.03x


def test_probes_go_on_across_short_replies():
    """A losing drafter probed at long intervals, then 60 replies of 24 tokens each (a server,
    a benchmark): plain steps count towards the next probe across replies, so the drafter is
    still probed (were each reply to start the count afresh, never again)."""
    policy = AdaptiveDraftLength(4)
    simulate(policy, [0.0], [0.2 * PLAIN], rounds=60)
    assert policy._probe_every > 24
    probes = 0
    for _ in range(60):
        policy.resume()
        left = 24
        while left > 0:
            choice = policy.choose(left)
            if choice.plain_tokens:
                n = min(choice.plain_tokens, left)
                policy.observe_plain(n, n * PLAIN)
                left -= n
                continue
            k = choice.num_draft
            probes += 1
            policy.observe_round(choice.arm, k, k, 0, k * 0.2 * PLAIN + verify_cost(k))
            left -= 1
    assert 3 <= probes <= 60 * 24 * policy.probe_budget * 4


def test_never_right_drafter_settles_on_plain_decoding():
    """A drafter that is never right: plain decoding within 5 choices; afterwards one probe
    round after each plain stretch, the stretches growing while the probes lose, until the
    probes cost at most about `probe_budget` (1%) of the time."""
    policy = AdaptiveDraftLength(8)
    choices = simulate(policy, [0.0], [0.2 * PLAIN], rounds=60)
    first = next(i for i, c in enumerate(choices) if c.plain_tokens and i > 0)
    assert first < 5
    stretches = [c.plain_tokens for c in choices[first:] if c.plain_tokens]
    assert stretches[0] == policy.probe_min
    assert all(b >= a for a, b in zip(stretches, stretches[1:], strict=False))
    probes = [c for c in choices[first:] if not c.plain_tokens]
    assert all(c.num_draft == 1 for c in probes)
    assert len(probes) <= len(stretches)
    # A probe (k = 1) costs 0.2 + 1.15 plain steps for one token: 0.35 steps lost each.
    late = stretches[len(stretches) // 2 :]
    assert 0.35 / min(late) <= 1.5 * policy.probe_budget, late
    assert max(stretches) <= 8 * 0.35 / policy.probe_budget + 1


def test_a_drafter_that_starts_winning_is_picked_up():
    """Never right for 40 choices, then always right: speculation resumes after a probe."""
    policy = AdaptiveDraftLength(4)
    simulate(policy, [0.0], [0.05 * PLAIN], rounds=40)
    choices = simulate(policy, [1.0], [0.05 * PLAIN], rounds=40, seed=1)
    assert sum(1 for c in choices[-10:] if c.num_draft == 4) >= 8


def test_k_follows_the_cost_of_verification():
    """Acceptance 0.7 per position: with verification nearly free (memory-bound) a long draft
    pays; when each verified token costs half a plain step (compute-bound), a short one."""
    cheap = AdaptiveDraftLength(8)
    simulate(cheap, [0.7], [0.05 * PLAIN], rounds=300, slope=0.01)
    dear = AdaptiveDraftLength(8)
    simulate(dear, [0.7], [0.05 * PLAIN], rounds=300, slope=0.5)
    k_cheap = cheap.choose(64).num_draft
    k_dear = dear.choose(64).num_draft
    assert k_cheap >= 4 and k_dear <= 2, (k_cheap, k_dear)


def test_the_better_drafter_is_chosen():
    """Two drafters of equal cost, acceptance 0.2 and 0.9: after 100 choices the better one
    drafts nearly every round."""
    policy = AdaptiveDraftLength(8, arms=2)
    choices = simulate(policy, [0.2, 0.9], [0.1 * PLAIN, 0.1 * PLAIN], rounds=100)
    late = [c.arm for c in choices[-30:] if not c.plain_tokens]
    assert late and late.count(1) >= 0.9 * len(late)


def test_a_costly_drafter_loses_to_a_free_one():
    """Equal acceptance 0.6; one drafter costs as much as the target, the other nothing."""
    policy = AdaptiveDraftLength(8, arms=2)
    choices = simulate(policy, [0.6, 0.6], [1.0 * PLAIN, 0.0], rounds=100)
    late = [c.arm for c in choices[-30:] if not c.plain_tokens]
    assert late and late.count(1) >= 0.9 * len(late)


def test_fixed_k_with_several_drafters_only_picks_the_drafter():
    policy = AdaptiveDraftLength(3, arms=2, fixed=3)
    choices = simulate(policy, [0.1, 0.8], [0.1 * PLAIN] * 2, rounds=60)
    assert all(c.num_draft == 3 and not c.plain_tokens for c in choices)
    assert [c.arm for c in choices[-20:]].count(1) >= 18


def test_acceptance_estimates_and_expected_tokens():
    """Position estimates follow the kept/reached counts; E(k) is 1 + sum of products."""
    policy = AdaptiveDraftLength(3, prior_weight=1e-9, decay=1.0)
    for accepted in (3, 3, 1, 0):  # position 1 reached 4 times, kept 3; position 2: 3 of 3 ...
        policy.observe_round(0, 3, 3, accepted, PLAIN)
    a = policy.acceptance(0)
    assert a == pytest.approx([0.75, 2 / 3, 1.0], abs=1e-6)
    assert policy.expected_tokens(0, 3) == pytest.approx(1 + 0.75 + 0.5 + 0.5, abs=1e-6)


def test_round_time_is_a_line_in_k():
    """Rounds of 1 and 3 drafts give the line through them. Rounds of one length alone lean
    on the prior slope above it and on a flat line below it (both dearer than the truth,
    never cheaper); a negative slope from noise is floored."""
    policy = AdaptiveDraftLength(8, alpha=1.0)
    policy.observe_plain(4, 4 * PLAIN)
    policy.observe_round(0, 1, 1, 0, 0.011)
    assert policy.round_seconds(0, 3) == pytest.approx(0.011 + 2 * 0.3 * PLAIN)
    for _ in range(20):
        policy.observe_round(0, 3, 3, 0, 0.013)
        policy.observe_round(0, 1, 1, 0, 0.011)
    assert policy.round_seconds(0, 2) == pytest.approx(0.012, rel=0.01)
    assert policy.round_seconds(0, 5) == pytest.approx(0.015, rel=0.02)
    assert policy.round_seconds(0, 0) == pytest.approx(0.010, rel=0.02)
    one_length = AdaptiveDraftLength(8)
    one_length.observe_plain(4, 4 * PLAIN)
    for _ in range(20):
        one_length.observe_round(0, 4, 4, 0, 0.014)
    assert one_length.round_seconds(0, 2) == pytest.approx(0.014 - 2 * 0.01 * PLAIN)  # floor
    assert one_length.round_seconds(0, 6) == pytest.approx(0.014 + 2 * 0.3 * PLAIN)
    noisy = AdaptiveDraftLength(8, alpha=1.0)
    noisy.observe_plain(4, 4 * PLAIN)
    for _ in range(20):
        noisy.observe_round(0, 1, 1, 0, 0.013)
        noisy.observe_round(0, 3, 3, 0, 0.011)
    assert noisy.round_seconds(0, 5) > noisy.round_seconds(0, 3)


def test_fewer_drafts_than_asked_count_as_rejections():
    """A lookup drafter that finds nothing half the time: the first position's estimate is
    the chance of a kept draft, not the acceptance of the drafts it found."""
    policy = AdaptiveDraftLength(4, prior_weight=1e-9, decay=1.0)
    for _ in range(10):
        policy.observe_round(0, 2, 2, 2, PLAIN)
        policy.observe_round(0, 2, 0, 0, PLAIN)
    assert policy.acceptance(0)[0] == pytest.approx(0.5)
    assert policy.arms[0].fill < 1.0


def test_bad_settings():
    with pytest.raises(ValueError, match="max_draft"):
        AdaptiveDraftLength(0)


def test_only_drafters_with_something_to_offer_are_chosen():
    """A lookup drafter (arm 1, free and always right when it finds a match) that has nothing
    now is passed over for the model drafter; with one draft available k is capped at one;
    with no drafter available the round is one plain step."""
    policy = AdaptiveDraftLength(4, arms=2)
    simulate(policy, [0.6, 1.0], [0.2 * PLAIN, 0.0], rounds=60)
    assert policy.choose(4, [None, 3]).arm == 1
    assert policy.choose(4, [None, 0]).arm == 0
    for _ in range(40):  # exploration of neighbouring k included
        choice = policy.choose(4, [None, 1])
        assert choice.arm == 0 or choice.num_draft == 1
    assert policy.choose(4, [0, 0]) == Choice(plain_tokens=1)


def test_a_losing_lookup_with_nothing_to_offer_gets_plain_stretches():
    """A lookup drafter that would lose even with a match (right 10% of the time: sampling at
    a high temperature) and finds nothing now: pipelined plain stretches with probes, not one
    synchronised plain step per token; a winning one with nothing now: one step, then look
    again."""
    losing = AdaptiveDraftLength(4)
    simulate(losing, [0.1], [0.0], rounds=60)
    stretches = [losing.choose(4, [0]) for _ in range(3)]
    assert all(c.plain_tokens > 1 for c in stretches)
    winning = AdaptiveDraftLength(4)
    simulate(winning, [1.0], [0.0], rounds=60)
    assert winning.choose(4, [0]) == Choice(plain_tokens=1)
    assert winning.choose(4, [2]) == Choice(0, 2)
