"""The forward tests' comparison rules (tests/forward/compare.py) on hand-made outputs: they run in the
default suite, without vLLM, so that a rule that could not fail would be caught here."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "forward"))
import compare  # noqa: E402


def out(tokens, steps):
    """An output: tokens, and per step [[token, logprob], ...] best first."""
    return {"tokens": tokens, "logprobs": [sorted(s, key=lambda x: -x[1]) for s in steps]}


REF = out([5, 7], [[[5, -1.0], [6, -1.5], [7, -2.0]], [[7, -1.0], [8, -1.01], [5, -3.0]]])


def test_identical_outputs_have_no_violation():
    assert compare.identical([REF], [json.loads(json.dumps(REF))])
    assert compare.violations([REF], [REF], tau=0.0) == []


def test_a_logprob_past_tau_is_a_violation():
    other = out([5, 7], [[[5, -1.0], [6, -1.5], [7, -2.2]], [[7, -1.0], [8, -1.01], [5, -3.0]]])
    assert not compare.identical([REF], [other])
    assert compare.violations([REF], [other], tau=0.25) == []
    (problem,) = compare.violations([REF], [other], tau=0.1)
    assert "step 0" in problem and "0.2000 > tau" in problem


def test_tokens_may_part_only_where_the_margin_is_below_two_tau():
    # step 1: the reference's top two are 0.01 apart; the other run picks the runner-up
    other = out([5, 8], [[[5, -1.0], [6, -1.5], [7, -2.0]], [[8, -1.0], [7, -1.005], [5, -3.0]]])
    assert compare.violations([REF], [other], tau=0.011) == []  # margin 0.01 < 2 tau: a near-tie may flip
    problems = compare.violations([REF], [other], tau=0.004)
    assert any("tokens differ at step 1" in p for p in problems)
    c = compare.compare_output(REF, other)
    assert (c.first_difference, c.steps) == (1, 2) and math.isclose(c.margin_there, 0.01)


def test_nothing_is_compared_after_the_tokens_part():
    other = out([6, 9], [[[6, -1.0], [5, -1.02], [7, -2.0]], [[9, -0.1], [1, -9.0], [2, -9.5]]])
    c = compare.compare_output(REF, other)
    assert c.steps == 1 and c.first_difference == 0 and math.isclose(c.max_abs_diff, 0.5)


def test_lists_parted_where_the_tokens_part_count_by_a_lower_bound():
    # step 1 of a near-flat distribution: the tokens part and the top-3 lists share no token
    flat = out([5, 7], [REF["logprobs"][0], [[7, -1.0], [8, -1.01], [5, -1.02]]])
    near = out([5, 9], [REF["logprobs"][0], [[9, -1.005], [4, -1.03], [3, -1.04]]])
    c = compare.compare_output(flat, near)
    assert c.first_difference == 1 and math.isclose(c.diffs[1], 0.04)  # 7 at -1.0 here, <= -1.04 there
    assert compare.violations([flat], [near], tau=0.05) == []
    # a confident other token there is far from the reference's floor: a violation, not a pass
    sure = out([5, 9], [REF["logprobs"][0], [[9, -0.1], [4, -3.0], [3, -3.5]]])
    assert math.isclose(compare.compare_output(flat, sure).diffs[1], 2.5)  # 7: -1.0 here, <= -3.5 there
    assert any("logprobs differ by 2.5000" in p for p in compare.violations([flat], [sure], tau=0.3))


def test_no_common_token_is_an_error():
    other = out([5, 7], [[[1, -1.0], [2, -1.5], [3, -2.0]], [[7, -1.0], [8, -1.01], [5, -3.0]]])
    with pytest.raises(AssertionError, match="no token in both"):
        compare.compare_output(REF, other)


def test_tolerance_follows_the_derivation(tiny_random):
    config = json.loads((tiny_random / "config.json").read_text())
    s = compare.logit_scale(tiny_random)
    assert 0.25 < s < 0.4  # head weights N(0, 0.02^2), 256 wide, final norm ~1: 0.02 * 16 * 1
    want = compare.GAIN * compare.COVERAGE * math.sqrt(2) * 2 ** -8 * math.sqrt(2 * config["num_hidden_layers"]) * s
    assert math.isclose(compare.tolerance(tiny_random), want)
    assert math.isclose(compare.tolerance(tiny_random, gain=1.0) * compare.GAIN, want)
