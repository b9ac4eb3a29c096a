"""What the forward tests compare, as pure functions over the runner's results (vllm_forward.py).

An output is {"tokens": [t0, t1, ...], "logprobs": [[[token, logprob], ...] per step, best first]}.

The TP tolerance
----------------
At TP size t > 1 every row-parallel layer returns fl(sum_r fl(p_r)) where TP1 returns fl(sum_r p_r):
each rank rounds its partial sum p_r to bf16 before the all-reduce, and the all-reduce's sum is rounded
again. With u = 2^-8 the unit roundoff of bf16 (8 significant bits) and first-order independent
rounding errors e with |e| <= u|x| and mean square u^2 x^2 / 3, the difference of one reduction's
output s has mean square (u^2/3) (sum_r p_r^2 + s^2 + s^2). Partial sums of random-signed products
have sum_r p_r^2 ~= s^2, so its relative size is sigma_1 = u, for any t >= 2.

The residual stream receives N such outputs: in vLLM's DeepSeek-V4 CPU model two per decoder layer,
the attention output projection (`wo_b`, RowParallelLinear) and the MoE, whose routed and shared
experts (`reduce_results=False`) are summed before one all-reduce; so N = 2 * num_hidden_layers.
Independent, they perturb the final hidden state h (after the final RMSNorm) by sigma_h = u * sqrt(N)
relative to |h|. A logit is z_v = w_v . h (the head is vocab-parallel: no split sum), so
dz_v = w_v . dh, whose standard deviation over the vocabulary is sigma_h * S with S = sigma_w * |h|,
sigma_w the standard deviation of the head's weights and |h| = sqrt(d) * rms(gamma) (RMSNorm output,
gamma the final norm's weight): S is the logits' own spread, read from the checkpoint (`logit_scale`).
A logprob is z_v - logsumexp(z), so dlp_v = dz_v - E_p[dz], of standard deviation at most
sqrt(2) * sigma_h * S. The largest of the few hundred compared logprobs stays below COVERAGE = 5
standard deviations of a Gaussian (P(|x| > 5 sd) = 6e-7 each).

That is a first-order, no-gain model: it ignores that the network amplifies a perturbation (attention
softmax, and above all the MoE router: a near-tie between two experts' scores flips which expert a
token gets, a discrete change). That gain is not derivable from the rounding; GAIN bounds it, set
from vLLM's own runs from the checkpoint at TP1, TP2 and TP4 (docs/evidence/serving-proof.md, "Tokens out":
largest gain 6.7 at TP2 on `forward`, 7.9 at TP4 on its 384-expert variant), times a safety factor of
1.5 for so few samples (7 prompts); the tests assert that vLLM's own pairs still stay within it, so
the bound is re-checked on every run:

    tau = GAIN * COVERAGE * sqrt(2) * u * sqrt(N) * S          (nats; 0 for the same TP size)

Two runs' logprobs of a token at the same step (same context) may differ by at most tau, so greedy
tokens may differ only at a step where the reference's top two are less than 2 * tau apart; from the
first differing token on, the contexts differ and nothing further is compared.

At the step where the tokens part, the two top-k lists may share no token: a near-flat distribution (a
random-fill model's, on the GPU) has hundreds of near-ties, and its top k are any k of them. A token
outside a list has at most that list's lowest logprob there, so the step's difference is at least
max(top_a - floor_b, top_b - floor_a, 0): that lower bound is what the step contributes.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

U = 2.0 ** -8  # bf16 unit roundoff: 7 stored + 1 implicit significand bits
COVERAGE = 5.0  # standard deviations that bound the largest of a few hundred compared logprobs
GAIN = 12.0  # network amplification over the first-order bound: 1.5 x the largest of vLLM's own TP noise (7.9)


def reductions(config: dict) -> int:
    """Row-parallel reductions in the residual stream: attention output and MoE, per decoder layer."""
    return 2 * int(config["num_hidden_layers"])


def logit_scale(model: Path) -> float:
    """S = sigma_w * sqrt(d) * rms(gamma): the spread of the logits over the vocabulary, from the
    checkpoint's head (`head.weight`) and final norm (`norm.weight`)."""
    from safetensors import safe_open

    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]

    def get(key: str):
        with safe_open(str(model / index[key]), "pt") as f:
            return f.get_tensor(key).float()

    head, gamma = get("head.weight"), get("norm.weight")
    return float(head.std()) * math.sqrt(gamma.numel()) * float(gamma.pow(2).mean().sqrt())


def tolerance(model: Path, gain: float = GAIN) -> float:
    """tau in nats (module docstring) for two TP sizes of `model`."""
    config = json.loads((model / "config.json").read_text())
    return gain * COVERAGE * math.sqrt(2.0) * U * math.sqrt(reductions(config)) * logit_scale(model)


@dataclass
class PromptComparison:
    """One prompt's two outputs: where the tokens first differ, and the logprob differences until then."""

    steps: int  # steps compared (up to and including the first differing token)
    first_difference: int | None  # step of the first differing token, None if all agree
    margin_there: float | None  # the reference's top-2 margin at that step (nats)
    max_abs_diff: float  # over tokens in both top-k lists, steps compared (a lower bound where none is)
    diffs: list[float] = field(default_factory=list)  # per step, the largest |dlp| there


def margin(step: list[list]) -> float:
    """Top-1 minus top-2 logprob of a step (best first)."""
    return float(step[0][1] - step[1][1])


def compare_output(ref: dict, other: dict) -> PromptComparison:
    n = min(len(ref["tokens"]), len(other["tokens"]))
    first = next((i for i in range(n) if ref["tokens"][i] != other["tokens"][i]), None)
    last = n - 1 if first is None else first
    diffs = []
    for i in range(last + 1):
        a, b = dict(map(tuple, ref["logprobs"][i])), dict(map(tuple, other["logprobs"][i]))
        common = set(a) & set(b)
        if common:
            diffs.append(max(abs(a[t] - b[t]) for t in common))
        elif i == first:  # each list's own token is its top: at least that far from the other's floor
            diffs.append(max(max(a.values()) - min(b.values()), max(b.values()) - min(a.values()), 0.0))
        else:  # the same token chosen, yet in one list only: not a greedy output
            raise AssertionError(f"step {i}: no token in both top-{len(a)} lists")
    return PromptComparison(steps=last + 1, first_difference=first,
                            margin_there=None if first is None else margin(ref["logprobs"][first]),
                            max_abs_diff=max(diffs), diffs=diffs)


def violations(ref: list[dict], other: list[dict], tau: float) -> list[str]:
    """What breaks the TP tolerance, per prompt: a token differing at a step whose reference margin is
    at least 2 * tau, or a logprob differing by more than tau before the contexts part."""
    problems = []
    for p, (a, b) in enumerate(zip(ref, other, strict=True)):
        c = compare_output(a, b)
        if c.first_difference is not None and c.margin_there >= 2 * tau:
            problems.append(f"prompt {p}: tokens differ at step {c.first_difference} ({a['tokens'][c.first_difference]} "
                            f"vs {b['tokens'][c.first_difference]}) where the reference's top-2 margin is "
                            f"{c.margin_there:.4f} >= 2 tau = {2 * tau:.4f}")
        if c.max_abs_diff > tau:
            step = max(range(c.steps), key=lambda i: c.diffs[i])
            problems.append(f"prompt {p}: step {step}: logprobs differ by {c.max_abs_diff:.4f} > tau = {tau:.4f}")
    return problems


def identical(a: list[dict], b: list[dict]) -> bool:
    """Bit-identical tokens and logprobs (the floats as the runner wrote them: every bit)."""
    return a == b
