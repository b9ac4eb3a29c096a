"""The smoke test's arithmetic and verdict, apart from any I/O (`smoke_client.py` talks to the server):
Prometheus text parsed into samples, draft acceptance from counter deltas, latency figures from
stream timings, and the checks with their thresholds.

The draft thresholds come from the field (docs/serving.md, "Checking a running server", cites them):
a healthy DSpark drafter at k=5 accepts about 100% of its drafts on a counting prompt and about 21%
on prose (colonel-otto's TP3 lane on DeepSeek-V4-Flash-0731); a drafter that loaded incompletely
(12 shared-expert parameters skipped) kept the output correct while first-position acceptance fell
from 0.83 to 0.63 on a mixed workload and tokens per step from 4.01 to 2.28 (tonyd2wild, "Patch 4").
On a counting prompt every healthy position accepts, so first-position acceptance below
COUNTING_FIRST_POSITION is that signature.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass, field

# vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py), as /metrics exposes them
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SPEC_COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POS)
COUNTING_FIRST_POSITION = 0.90  # healthy: ~1.00 on counting; the incomplete drafter: 0.63 on a mixed workload
MAX_CONCURRENCY = 32  # --concurrency's hard cap: a smoke test, not a load test

OK, FAIL, WARN, INFO, SKIP = "ok", "FAIL", "warn", "info", "skip"
# The drafter rule, stated wherever its verdict is: a heuristic from two field figures, not a measured bound
DRAFTER_RULE = (f"heuristic: first-position acceptance >= {COUNTING_FIRST_POSITION:.2f} on the counting prompt (a "
                f"healthy DSpark at k=5 ~1.00 there; an incompletely loaded drafter 0.63 on a mixed workload), "
                f"which a partly working drafter may still clear; per-position rates on random or repeated ids run "
                f"higher than on prose")


class MetricsError(ValueError):
    """A /metrics body that is not Prometheus' text format, or counters that are no counts."""


class Restarted(ValueError):
    """Spec-decode counters that went backwards, appeared or vanished between two reads: a restarted server."""


# The text format's values (Go's float syntax as Prometheus writes it). prometheus_client's parser reads a value
# with float(), which also takes "nan", "Infinity", "1_000"'s kin and non-ASCII digits ("１" as 1), none of which an
# exporter writes: each sample's value and timestamp are held to the format's grammar before the parser reads it.
_VALUE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?Inf|NaN")
_TIMESTAMP = re.compile(r"-?[0-9]+")
MAX_COUNT = 2 ** 53  # the largest count a float holds exactly
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*[{ \t]")  # a sample line starts with its metric's name


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition format -> {sample name: [(labels, value), ...]}, each sample line read by
    prometheus_client's text parser (`text_string_to_metric_families`, the library vLLM exports with), one
    line at a time so that a refusal names its line; comments skipped. Raises MetricsError naming the first
    line that is not a sample."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        # the value and the timestamp follow the labels' closing brace (a label value may hold spaces), else the name
        tail = line.rpartition("}")[2] if "{" in line else line.partition(" ")[2]
        fields = tail.split()
        if not 1 <= len(fields) <= 2 or not _NAME.match(line):
            raise MetricsError(f"line {n} is not a Prometheus sample: {line[:80]!r}")
        if not _VALUE.fullmatch(fields[0]):
            raise MetricsError(f"line {n}: value {fields[0][:40]!r} is not a number")
        if len(fields) == 2 and not _TIMESTAMP.fullmatch(fields[1]):
            raise MetricsError(f"line {n}: timestamp {fields[1][:40]!r} is not milliseconds")
        try:
            parsed = [x for family in text_string_to_metric_families(line + "\n") for x in family.samples]
        except ValueError as e:
            what = f"bad labels {{{line.partition('{')[2].rpartition('}')[0][:60]}}}" if "{" in line else "not a sample"
            raise MetricsError(f"line {n}: {what} ({e})") from None
        for sample in parsed:
            samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return samples


@dataclass(frozen=True)
class SpecCounters:
    """The spec-decode counters at one moment, summed over engines (and models)."""

    drafts: float
    draft_tokens: float
    accepted: float
    per_position: tuple[float, ...]  # accepted tokens at draft position 0, 1, ...

    def minus(self, before: "SpecCounters") -> "SpecCounters":
        """The counts between `before` and this moment (a position first seen now started at 0). Raises
        Restarted where a count went down: a counter only grows while its server runs."""
        k = max(len(self.per_position), len(before.per_position))
        now, then = (v + (0.0,) * (k - len(v)) for v in (self.per_position, before.per_position))
        pairs = [(DRAFTS, self.drafts, before.drafts), (DRAFT_TOKENS, self.draft_tokens, before.draft_tokens),
                 (ACCEPTED, self.accepted, before.accepted),
                 *((f"{ACCEPTED_PER_POS} at position {i}", a, b) for i, (a, b) in enumerate(zip(now, then)))]
        for name, a, b in pairs:
            if a < b:
                raise Restarted(f"{name} went from {b:.0f} to {a:.0f} between two reads: the server restarted (or "
                                f"its counters were reset), so no acceptance can be read from them")
        return SpecCounters(*(a - b for _, a, b in pairs[:3]), tuple(a - b for _, a, b in pairs[3:]))


def counter_delta(before: SpecCounters | None, after: SpecCounters | None) -> SpecCounters:
    """The counts between two reads of the counters, as `after.minus(before)`. Raises Restarted where the
    counters appeared or vanished between them (vLLM registers them at start, with a speculative config)."""
    if before is None or after is None:
        raise Restarted("the spec-decode counters appeared or vanished between two reads: the server restarted "
                        "with other options")
    return after.minus(before)


def _count(name: str, labels: dict[str, str], value: float) -> float:
    """`value` of a counter sample, when it is a count: whole, not negative, exact in a float."""
    if not (value.is_integer() and 0 <= value <= MAX_COUNT):  # NaN and the infinities are not integers
        text = "NaN" if math.isnan(value) else f"{value:+}".replace("inf", "Inf") if math.isinf(value) else f"{value:g}"
        raise MetricsError(f"{name}{_labels(labels)} is {text}, not a count of at most 2^53")
    return value


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v[:40]}"' for k, v in labels.items()) + "}" if labels else ""


def spec_counters(samples: dict[str, list[tuple[dict[str, str], float]]]) -> SpecCounters | None:
    """The spec-decode counters of a parsed /metrics, or None when the server does not draft (vLLM
    registers them only with a speculative config). Raises MetricsError for a value that is no count, or
    positions that are not vLLM's 0..k-1, one per draft position (so the tuple is no longer than the text)."""
    if DRAFTS not in samples:
        return None
    total = {name: sum(_count(name, labels, v) for labels, v in samples.get(name, []))
             for name in (DRAFTS, DRAFT_TOKENS, ACCEPTED)}
    by_pos: dict[int, float] = {}
    for labels, value in samples.get(ACCEPTED_PER_POS, []):
        label = labels.get("position", "")
        if not re.fullmatch(r"[0-9]{1,9}", label):
            raise MetricsError(f"{ACCEPTED_PER_POS} has position {label[:40]!r}, not a draft position (0, 1, ...)")
        by_pos[int(label)] = by_pos.get(int(label), 0.0) + _count(ACCEPTED_PER_POS, labels, value)
    if by_pos and max(by_pos) >= len(by_pos):
        raise MetricsError(f"{ACCEPTED_PER_POS} has {len(by_pos)} position(s), the highest {max(by_pos)}: vLLM's "
                           f"counts one for each draft position 0..k-1")
    return SpecCounters(total[DRAFTS], total[DRAFT_TOKENS], total[ACCEPTED], tuple(by_pos[i] for i in range(len(by_pos))))


@dataclass(frozen=True)
class Acceptance:
    """Draft acceptance over one prompt, from the counters' deltas around it."""

    prompt: str
    drafts: int
    draft_tokens: int
    accepted: int
    per_position: tuple[float, ...]  # accepted / drafts at each position, 0..1
    rate: float  # accepted / draft tokens
    tokens_per_step: float  # 1 + accepted / drafts: what each target step emits

    def to_dict(self) -> dict:
        return asdict(self)


def acceptance(prompt: str, delta: SpecCounters) -> Acceptance:
    """Acceptance rates of `delta` (after minus before); NaN where nothing was drafted."""
    drafts = delta.drafts
    per = tuple(a / drafts if drafts else math.nan for a in delta.per_position)
    return Acceptance(prompt, int(drafts), int(delta.draft_tokens), int(delta.accepted), per,
                      delta.accepted / delta.draft_tokens if delta.draft_tokens else math.nan,
                      1 + delta.accepted / drafts if drafts else math.nan)


@dataclass(frozen=True)
class Stream:
    """One streamed completion's timings: request sent at 0, each token's arrival in seconds."""

    arrivals: tuple[float, ...]
    tokens: int  # the server's usage count (a chunk may carry several tokens)

    @property
    def ttft(self) -> float:
        return self.arrivals[0]

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over the time after the first: the decode rate, prefill excluded."""
        span = self.arrivals[-1] - self.arrivals[0]
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else math.nan


@dataclass(frozen=True)
class Latency:
    """Streams run together at one concurrency."""

    concurrency: int
    wall_s: float
    ttft_s: tuple[float, ...]
    decode_tok_s: tuple[float, ...]  # per request
    tokens: int

    def to_dict(self) -> dict:
        return {**asdict(self), "ttft_median_s": statistics.median(self.ttft_s),
                "decode_tok_s_median": _median(self.decode_tok_s), "total_tok_s": self.total_tok_s}

    @property
    def total_tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else math.nan

    def line(self) -> str:
        ttft = statistics.median(self.ttft_s)
        if self.concurrency == 1:
            return f"concurrency 1: time to first token {ttft:.3f} s, decode {_median(self.decode_tok_s):.1f} tok/s"
        return (f"concurrency {self.concurrency}: time to first token median {ttft:.3f} s (max {max(self.ttft_s):.3f}), "
                f"decode {_median(self.decode_tok_s):.1f} tok/s per request, {self.total_tok_s:.1f} tok/s together")


def latency(concurrency: int, wall_s: float, streams: list[Stream]) -> Latency:
    return Latency(concurrency, wall_s, tuple(s.ttft for s in streams), tuple(s.decode_tok_s for s in streams),
                   sum(s.tokens for s in streams))


def _median(values) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, FAIL, INFO, SKIP
    detail: str

    def __str__(self) -> str:
        return f"[{self.status:>4}] {self.name}: {self.detail}"

    def to_dict(self) -> dict:
        return asdict(self)


def model_check(served: list[str], expected: str | None) -> Check:
    if not served:
        return Check("models", FAIL, "/v1/models lists no model: the server has not finished loading, or serves none")
    if expected is None:
        return Check("models", OK, f"serves {', '.join(served)}")
    if expected in served:
        return Check("models", OK, f"serves {expected}")
    return Check("models", FAIL, f"{expected} is not served (the server has {', '.join(served) or 'no model'}); "
                                 f"pass --model with one of those, or serve {expected}")


def repeat_check(first: str, second: str, tokens: int, batch_invariant: bool = False) -> Check:
    """The same greedy request twice should give the same output: a failure where the server runs with batch
    invariance (`batch_invariant`: VLLM_BATCH_INVARIANT=1, which smoke cannot see), else a warning, since vLLM
    promises identical online outputs only then, and the second request may read the first's prefix cache."""
    if first == second:
        return Check("greedy repeat", OK, f"{tokens} tokens at temperature 0, identical twice")
    at = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    differ = (f"the same greedy request gave two outputs (they differ from character {at}: {first[at:at + 24]!r} vs "
              f"{second[at:at + 24]!r})")
    if batch_invariant:
        return Check("greedy repeat", FAIL, f"{differ}: the server does not sample greedily, or its numerics are "
                                            f"not deterministic although it runs with batch invariance")
    return Check("greedy repeat", WARN, f"{differ}; vLLM promises identical outputs only with batch invariance "
                                        f"(VLLM_BATCH_INVARIANT=1 on the server, then pass --batch-invariant to make "
                                        f"this a failure), and the second request may read the first's prefix cache")


def draft_checks(counting: Acceptance | None, prose: Acceptance | None, expect_draft: bool,
                 threshold: float = COUNTING_FIRST_POSITION) -> list[Check]:
    """The verdict on drafting: skipped where the server does not draft (a failure with
    --expect-draft), else the counting prompt's (or its token-id analogue's: `counting.prompt` names it)
    first-position acceptance against `threshold`."""
    if counting is None or prose is None:
        if expect_draft:
            return [Check("draft", FAIL, "--expect-draft, but the server does not draft (no vllm:spec_decode_* "
                                         "counters at /metrics): serve with --draft (--speculative-config)")]
        return [Check("draft", SKIP, "the server does not draft (no vllm:spec_decode_* counters at /metrics)")]
    checks = [Check(f"draft acceptance, {a.prompt}", INFO, _acceptance_text(a)) for a in (counting, prose)]
    first = counting.per_position[0] if counting.per_position else math.nan
    if counting.drafts == 0 or math.isnan(first):
        checks.append(Check("drafter", FAIL, f"the server has spec-decode counters but drafted nothing on the "
                                             f"{counting.prompt} prompt (another request running?  run smoke on an "
                                             f"idle server)"))
    elif first < threshold:
        checks.append(Check("drafter", FAIL, f"first-position acceptance {first:.2f} on the {counting.prompt} prompt, below "
                                             f"{threshold:.2f}: the signature of a drafter that loaded incompletely "
                                             f"(a healthy DSpark accepts ~1.00 there); check the draft weights "
                                             f"(lucifer-shard verify OUT) and vLLM's load log ({DRAFTER_RULE})"))
    else:
        checks.append(Check("drafter", OK, f"first-position acceptance {first:.2f} on the {counting.prompt} prompt (>= "
                                           f"{threshold:.2f}; {DRAFTER_RULE})"))
    return checks


def _acceptance_text(a: Acceptance) -> str:
    per = " ".join("-" if math.isnan(p) else f"{p:.2f}" for p in a.per_position)
    return (f"{a.accepted}/{a.draft_tokens} draft tokens accepted ({_pct(a.rate)}), per position {per or '-'}, "
            f"{a.tokens_per_step:.2f} tokens per step over {a.drafts} drafts")


def _pct(rate: float) -> str:
    return "-" if math.isnan(rate) else f"{rate:.1%}"


@dataclass
class Report:
    url: str
    version: str
    model: str
    checks: list[Check] = field(default_factory=list)
    prompts: str = "text"  # "text", or "token ids (why)": what the prompts were sent as
    latency: list[Latency] = field(default_factory=list)
    acceptance: list[Acceptance] = field(default_factory=list)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def to_dict(self) -> dict:
        return {"url": self.url, "vllm_version": self.version, "model": self.model, "prompts": self.prompts,
                "ok": not self.failed,
                "checks": [c.to_dict() for c in self.checks], "latency": [lat.to_dict() for lat in self.latency],
                "acceptance": [a.to_dict() for a in self.acceptance]}

    def lines(self) -> list[str]:
        out = [f"smoke {self.url}: vLLM {self.version}, model {self.model}", f"prompts: {self.prompts}",
               *map(str, self.checks)]
        warned = sum(c.status == WARN for c in self.checks)
        verdict = (f"smoke failed: {len(self.failed)} check(s)" if self.failed
                   else f"smoke passed ({sum(c.status == OK for c in self.checks)} checks"
                        + (f", {warned} warning(s))" if warned else ")"))
        return [*out, verdict]
