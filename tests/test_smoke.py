"""`lucifer-shard smoke`: the pure parts (Prometheus text, acceptance from counter deltas, the verdict) and
the error paths, against a stand-in server (tests/vllmstandin.py). Against vLLM's own server:
tests/forward/test_smoke_server.py."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from lucifer_shard.errors import ERROR_KINDS
from lucifer_shard.proof import smoke as sm

from helpers import one_error, run
from vllmstandin import MODEL, StandIn

# What vLLM 0.32.0's /metrics holds for a drafting server (names and labels of vllm/v1/spec_decode/metrics.py;
# the figures made up), with the comment lines and another family around it.
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 20.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 600.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 270.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 100.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 80.0
vllm:num_requests_running{model_name="a \\"quoted\\", name"} 0.0
"""


# ---------------------------------------------------------------- the pure parts


def test_prometheus_text_is_parsed_with_labels_and_comments_skipped():
    samples = sm.parse_metrics(METRICS)
    assert samples["vllm:spec_decode_num_drafts_total"] == [({"engine": "0", "model_name": "m"}, 100.0),
                                                            ({"engine": "1", "model_name": "m"}, 20.0)]
    assert samples["vllm:num_requests_running"] == [({"model_name": 'a "quoted", name'}, 0.0)]
    assert "# HELP" not in str(samples)


def test_what_prometheus_client_writes_is_read_back():
    """Label values with braces, spaces, quotes, backslashes and newlines, as prometheus_client's own writer
    (the library vLLM exports with) escapes them, come back as they were, with the values."""
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter("vllm:spec_decode_num_drafts", "drafts", ["model_name", "engine"],
                                        registry=registry)
    odd = 'a} 1 "x" \\ y\nz {b="c"}'
    counter.labels(odd, "0").inc(7)
    counter.labels("m", "1").inc(2)
    samples = sm.parse_metrics(prometheus_client.generate_latest(registry).decode())
    assert sorted(samples[sm.DRAFTS], key=lambda s: s[0]["engine"]) == [({"engine": "0", "model_name": odd}, 7.0),
                                                                         ({"engine": "1", "model_name": "m"}, 2.0)]
    for bad in ('{a="b"} 1\n', '{not: prometheus} 1\n'):
        with pytest.raises(sm.MetricsError, match="line 1 is not a Prometheus sample"):
            sm.parse_metrics(bad)


@pytest.mark.parametrize("text,where", [("vllm:x{engine=\"0\"} abc\n", "line 1: value 'abc'"),
                                        ("ok 1\n{not: prometheus}\n", "line 2 is not a Prometheus sample"),
                                        ('vllm:x{engine=0} 1\n', "line 1: bad labels")])
def test_malformed_prometheus_text_names_the_line(text, where):
    with pytest.raises(sm.MetricsError, match=where.replace("{", r"\{")):
        sm.parse_metrics(text)


def test_counters_sum_over_engines_and_positions_in_order():
    c = sm.spec_counters(sm.parse_metrics(METRICS))
    assert c == sm.SpecCounters(drafts=120.0, draft_tokens=600.0, accepted=270.0, per_position=(120.0, 70.0, 80.0))
    assert sm.spec_counters(sm.parse_metrics('vllm:num_requests_running{model_name="m"} 0\n')) is None


def test_acceptance_is_the_counters_delta_over_the_drafts():
    before = sm.SpecCounters(10, 50, 20, (8, 7, 5))
    after = sm.SpecCounters(110, 550, 320, (108, 87, 45, 0))  # a position seen only afterwards counts too
    a = sm.acceptance("counting", after.minus(before))
    assert (a.drafts, a.draft_tokens, a.accepted) == (100, 500, 300)
    assert a.per_position == (1.0, 0.8, 0.4, 0.0)
    assert a.rate == pytest.approx(0.6) and a.tokens_per_step == pytest.approx(4.0)
    nothing = sm.acceptance("prose", sm.SpecCounters(0, 0, 0, (0,)))
    assert math.isnan(nothing.rate) and math.isnan(nothing.per_position[0]) and math.isnan(nothing.tokens_per_step)


def _acc(prompt: str, first: float, drafts: int = 64) -> sm.Acceptance:
    return sm.acceptance(prompt, sm.SpecCounters(drafts, drafts * 2, drafts * first * 1.5,
                                                 (drafts * first, drafts * first / 2)))


@pytest.mark.parametrize("first,status", [(1.0, sm.OK), (0.9, sm.OK), (0.63, sm.FAIL), (0.0, sm.FAIL)])
def test_the_drafter_verdict_is_first_position_acceptance_on_counting(first, status):
    """0.63: the field's incomplete drafter (first-position acceptance on a mixed workload, which a healthy
    drafter beats on counting)."""
    checks = sm.draft_checks(_acc("counting", first), _acc("prose", 0.2), expect_draft=False)
    assert [c.status for c in checks] == [sm.INFO, sm.INFO, status]
    if status == sm.FAIL:
        assert "signature of a drafter that loaded incompletely" in checks[-1].detail


def test_no_draft_is_skipped_unless_expected_and_nothing_drafted_fails():
    assert [c.status for c in sm.draft_checks(None, None, expect_draft=False)] == [sm.SKIP]
    assert [c.status for c in sm.draft_checks(None, None, expect_draft=True)] == [sm.FAIL]
    idle = sm.draft_checks(_acc("counting", 1.0, drafts=0), _acc("prose", 0.2), expect_draft=False)
    assert idle[-1].status == sm.FAIL and "drafted nothing" in idle[-1].detail


def test_stream_rates_exclude_the_first_token():
    s = sm.Stream((0.5, 0.6, 0.7, 0.9), tokens=5)  # the last chunk carried two tokens
    assert s.ttft == 0.5 and s.decode_tok_s == pytest.approx(4 / 0.4)
    assert math.isnan(sm.Stream((0.5,), tokens=1).decode_tok_s)
    lat = sm.latency(2, 2.0, [s, sm.Stream((0.7, 1.1), tokens=3)])
    assert lat.tokens == 8 and lat.total_tok_s == 4.0 and lat.to_dict()["ttft_median_s"] == pytest.approx(0.6)


def test_the_models_check():
    assert sm.model_check(["a", "b"], None) == sm.Check("models", sm.OK, "serves a, b")
    assert sm.model_check(["a", "b"], "b").status == sm.OK
    assert sm.model_check(["a"], "c").status == sm.FAIL and sm.model_check([], None).status == sm.FAIL


def test_the_greedy_repeat_names_where_the_outputs_differ():
    assert sm.repeat_check("abc", "abc", 3).status == sm.OK
    bad = sm.repeat_check("the cat", "the dog", 2, batch_invariant=True)
    assert bad.status == sm.FAIL and "from character 4" in bad.detail and "'cat' vs 'dog'" in bad.detail


def test_a_greedy_repeat_that_differs_is_a_warning_unless_the_server_is_batch_invariant():
    """vLLM promises identical online outputs only with VLLM_BATCH_INVARIANT=1, which smoke cannot see: without
    --batch-invariant two outputs that differ are a warning and smoke passes (before: a failure, exit 1)."""
    warn = sm.repeat_check("the cat", "the dog", 2)
    assert warn.status == sm.WARN and "'cat' vs 'dog'" in warn.detail
    assert "VLLM_BATCH_INVARIANT=1" in warn.detail and "--batch-invariant" in warn.detail
    with StandIn(fault="random") as s:
        r = run("smoke", s.url, "--max-tokens", "4", "--concurrency", "1")
    assert r.exit_code == 0, r.output
    assert "[warn] greedy repeat: the same greedy request gave two outputs" in r.stdout
    assert "smoke passed (1 checks, 1 warning(s))" in r.stdout


def test_the_drafter_verdict_says_it_is_a_heuristic_with_its_threshold():
    for first in (1.0, 0.5):
        (verdict,) = sm.draft_checks(_acc("counting", first), _acc("prose", 0.2), expect_draft=False)[-1:]
        assert "heuristic: first-position acceptance >= 0.90 on the counting prompt" in verdict.detail
        assert "a partly working drafter may still clear" in verdict.detail


# ---------------------------------------------------------------- against the stand-in


def test_a_healthy_drafting_server_passes_with_every_figure():
    with StandIn(accept=(1.0, 0.9, 0.8)) as s:
        r = run("smoke", f"{s.url}/v1/", "--model", MODEL, "--max-tokens", "8", "--concurrency", "3", "--json")  # OpenAI's base
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["ok"], r.output
    result = doc["result"]
    assert result["url"] == s.url
    assert [lat["concurrency"] for lat in result["latency"]] == [1, 3]
    assert [len(lat["ttft_s"]) for lat in result["latency"]] == [1, 3]
    assert [a["prompt"] for a in result["acceptance"]] == ["counting", "prose"]
    assert result["acceptance"][0]["per_position"] == [1.0, pytest.approx(0.9, abs=0.02), pytest.approx(0.8, abs=0.02)]
    assert [c["name"] for c in result["checks"]] == ["models", "greedy repeat", "latency", "latency",
                                                     "draft acceptance, counting", "draft acceptance, prose", "drafter"]


def test_a_server_without_a_tokenizer_is_checked_on_token_ids():
    """vLLM started with --skip-tokenizer-init (every GPU-harness server) answers a text prompt HTTP 400: smoke
    turns to token-id prompts, says so and why, and reads the drafter's acceptance on them (before: exit 2 at
    the greedy request)."""
    with StandIn(accept=(1.0, 0.5), tokenizer=False) as s:
        r = run("smoke", s.url, "--max-tokens", "8", "--concurrency", "2", "--expect-draft", "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["ok"], r.output
    result = doc["result"]
    assert result["prompts"].startswith("token ids (the server refused a text prompt: ")
    assert "HTTP 400: Tokenizer not available when `skip_tokenizer_init=True`" in result["prompts"]
    assert [a["prompt"] for a in result["acceptance"]] == ["repeating ids", "random ids"]
    assert result["acceptance"][0]["per_position"] == [1.0, 0.5]
    assert [lat["tokens"] for lat in result["latency"]] == [8, 16]
    drafter = {c["name"]: c for c in result["checks"]}["drafter"]
    assert drafter["status"] == "ok" and "on the repeating ids prompt" in drafter["detail"]
    with StandIn(tokenizer=False) as s:
        r = run("smoke", s.url, "--max-tokens", "4", "--concurrency", "1")
    assert r.exit_code == 0 and "prompts: token ids (the server refused a text prompt" in r.stdout, r.output


def test_the_prompts_are_what_prompts_says():
    from lucifer_shard.proof.smoke_client import ID_HI, ID_LO, TOKEN_GREEDY, TOKEN_PROMPTS

    with StandIn(tokenizer=False) as s:
        r = run("smoke", s.url, "--max-tokens", "4", "--concurrency", "1", "--prompts", "text", "--json")
    _server_line(r, "/v1/completions: HTTP 400: Tokenizer not available")
    with StandIn() as s:
        r = run("smoke", s.url, "--max-tokens", "4", "--concurrency", "1", "--prompts", "tokens", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["result"]["prompts"] == "token ids (--prompts tokens)", r.output
    with StandIn() as s:
        r = run("smoke", s.url, "--max-tokens", "4", "--concurrency", "1", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["result"]["prompts"] == "text", r.output
    cycle = TOKEN_PROMPTS["repeating ids"]
    assert cycle == cycle[:16] * 6 and len(set(cycle[:16])) > 1
    assert all(ID_LO <= i < ID_HI for p in (TOKEN_GREEDY, *TOKEN_PROMPTS.values()) for i in p)


@pytest.mark.parametrize("standin,args,failed", [
    (dict(accept=(0.5, 0.25)), (), "drafter: first-position acceptance 0.50 on the counting prompt, below 0.90"),
    (dict(fault="random"), ("--batch-invariant",), "greedy repeat: the same greedy request gave two outputs"),
    (dict(), ("--model", "other/model"), "models: other/model is not served (the server has standin/flash-tp3)"),
    (dict(), ("--expect-draft",), "draft: --expect-draft, but the server does not draft"),
])
def test_a_failed_check_exits_1_naming_it(standin, args, failed):
    with StandIn(**standin) as s:
        r = run("smoke", s.url, "--max-tokens", "4", "--concurrency", "2", *args)
    assert r.exit_code == ERROR_KINDS["check_failed"][0] == 1, r.output
    assert f"[FAIL] {failed}" in r.stdout
    assert r.stderr.startswith(f"error: smoke: 1 check(s) failed; first: [FAIL] {failed}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("standin,url,message", [
    (None, "http://127.0.0.1:{port}", "cannot reach the server"),
    (dict(fault="not_json"), None, "/v1/models: the answer is not JSON ('<html>a web page</html>')"),
    (dict(fault="not_vllm"), None, "answers /v1/models but not vLLM's /version (HTTP 404)"),
    (dict(fault="bad_metrics"), None, "/metrics: line 1 is not a Prometheus sample"),
    (dict(fault="slow", delay=3.0), None, "no answer within --timeout 1 s (at: GET /version)"),
])
def test_a_server_that_cannot_be_checked_is_one_line_of_kind_server(standin, url, message):
    if standin is None:
        r = run("smoke", url.format(port=_free_port()), "--timeout", "1", "--json")
    else:
        with StandIn(**standin) as s:
            r = run("smoke", s.url, "--timeout", "1", "--max-tokens", "2", "--concurrency", "1", "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 2 and doc["error"]["kind"] == "server", r.output
    assert message in doc["error"]["message"] and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:8000", "http://", "/tmp/a/path"])
def test_what_is_no_http_url_is_a_usage_error(url):
    r = run("smoke", url, "--json")
    assert r.exit_code == 2 and json.loads(r.stdout)["error"]["kind"] == "usage"
    assert "not an http(s) URL; pass the server's base URL" in r.stderr


# ---------------------------------------------------------------- hostile servers (issue 61, class F)

# smoke ends within --timeout plus this, counted from the process's start (the interpreter's start, about
# 0.4 s, is in it); its peak memory stays under HOSTILE_RSS whatever the server sends (an idle run: 42 MiB).
MARGIN_S = 2.0
HOSTILE_RSS = 128 << 20
DRAFTS_SAMPLE = f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="{MODEL}"}}'
# The CLI, then its own peak RSS written to $SMOKE_HWM: /proc's VmHWM is this process's alone (getrusage's
# and wait4's maxrss keep the forking pytest's, some 240 MiB with torch, across exec). The CLI leaves through
# os._exit (lucifer_shard.stops.exit_now: no interpreter finalization), so the harness writes it there.
_PEAK = """import os, runpy
_exit = os._exit
def _exit_after_writing_the_peak(code):
    status = open("/proc/self/status").read()
    open(os.environ["SMOKE_HWM"], "w").write(status.split("VmHWM:")[1].split()[0])
    _exit(code)
os._exit = _exit_after_writing_the_peak
runpy.run_module("lucifer_shard.cli", run_name="__main__")
"""


def _smoke_process(url: str, *args: str, timeout: float = 3.0) -> tuple[subprocess.CompletedProcess, float, int]:
    """`lucifer-shard smoke URL --timeout T --json ARGS` in a fresh interpreter: the run, its wall seconds and
    its peak RSS in bytes (0 when it was killed). Killed at T + MARGIN_S + 5 s, so a run that would never end
    fails the test instead of hanging it."""
    argv = [sys.executable, "-c", _PEAK, "smoke", url, "--timeout", str(timeout), "--json", *args]
    with tempfile.TemporaryDirectory() as tmp:
        hwm = os.path.join(tmp, "hwm")
        t0 = time.monotonic()
        try:
            p = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "SMOKE_HWM": hwm},
                               timeout=timeout + MARGIN_S + 5)
        except subprocess.TimeoutExpired as e:  # its partial output comes as bytes
            p = subprocess.CompletedProcess(argv, -9, *((x or b"").decode() for x in (e.stdout, e.stderr)))
        wall = time.monotonic() - t0
        rss = int(open(hwm).read()) << 10 if os.path.exists(hwm) else 0
    return p, wall, rss


def _server_line(r, *needles: str) -> str:
    """The run's one error line, of kind `server` (exit 2) in --json's envelope too, holding `needles`."""
    line = one_error(r, 2, *needles)
    assert json.loads(r.stdout)["error"]["kind"] == "server", r.stdout
    return line


@pytest.mark.parametrize("standin,args,step", [
    (dict(fault="drip_head", delay=1.0), (), "GET /version"),
    (dict(fault="drip_body", delay=1.0), (), "GET /version"),
    (dict(fault="endless_stream"), ("--concurrency", "1"), "latency at concurrency 1"),
    (dict(fault="endless_stream", spare=1), ("--concurrency", "32"), "latency at concurrency 32"),
], ids=["drip-head", "drip-body", "endless-stream", "endless-stream-x32"])
def test_a_server_that_never_finishes_ends_smoke_within_its_timeout(standin, args, step):
    """A whole-run deadline, not a bound on each socket read: a byte a second, or a stream kept alive, is
    cut when --timeout passes (before: still running after 130 s with --timeout 10)."""
    with StandIn(**standin) as s:
        r, wall, _ = _smoke_process(s.url, "--max-tokens", "4", *args)
    _server_line(r, f"no answer within --timeout 3 s (at: {step})")
    assert wall <= 3 + MARGIN_S, wall



def test_a_deadline_that_passes_while_connecting_still_cuts_the_answer(monkeypatch):
    """A connection that takes longer than --timeout to open (a slow name lookup, which no timer can
    interrupt), to a server that then drips: the deadline passed before there was a socket to cut, and the
    answer must still end the run (before: its every byte, 0.1 s each, read past the deadline)."""
    opened = socket.create_connection

    def slow(*args, **kw):
        time.sleep(1.5)
        return opened(*args, **kw)

    monkeypatch.setattr(socket, "create_connection", slow)
    with StandIn(fault="drip_head", delay=0.1) as s:
        t0 = time.monotonic()
        r = run("smoke", s.url, "--timeout", "1", "--json")
        wall = time.monotonic() - t0
    _server_line(r, "no answer within --timeout 1 s (at: GET /version)")
    assert wall <= 1.5 + MARGIN_S, wall

@pytest.mark.parametrize("standin,needle", [
    (dict(fault="huge", at="/v1/models", size=300 << 20), "/v1/models: the answer is larger than 8 MiB"),
    (dict(fault="huge", at="/v1/completions", size=300 << 20), "/v1/completions: the answer is larger than 8 MiB"),
    (dict(fault="huge", at="/metrics", size=300 << 20, accept=(1.0,)), "/metrics: the answer is larger than 8 MiB"),
    (dict(fault="huge_line", size=500 << 20), "/v1/completions: a stream line is longer than 1 MiB"),
    (dict(fault="huge_line", size=500 << 20, spare=1), "/v1/completions: a stream line is longer than 1 MiB"),
    (dict(fault="token_flood"), "/v1/completions: the stream carried more than the 4 tokens asked"),
], ids=["json-models", "json-completion", "metrics", "stream-line", "stream-line-x32", "token-flood"])
def test_an_answer_too_large_is_refused_in_bounded_memory(standin, needle):
    """Before: a 300 MB JSON answer and a 500 MB stream line were read into memory whole (peak 5.0 GiB for
    /v1/models, 2.2 GiB and a pass for the line); a stream of tokens that never stops, never ended."""
    concurrency = "32" if standin.get("spare") else "1"  # 32 streams at once, after concurrency 1 was served whole
    with StandIn(**standin) as s:
        r, _, rss = _smoke_process(s.url, "--max-tokens", "4", "--concurrency", concurrency, timeout=30)
    _server_line(r, needle)
    assert 0 < rss < HOSTILE_RSS, f"peak RSS {rss / 2**20:.0f} MiB"


@pytest.mark.parametrize("standin,needle", [
    (dict(fault="deep"), "/v1/models: the answer is not JSON"),
    (dict(tokens="[1]"), "usage.completion_tokens is [1], not a count"),
    (dict(tokens='"many"'), "usage.completion_tokens is 'many', not a count"),
    (dict(tokens='{"n": 1}'), "usage.completion_tokens is {'n': 1}, not a count"),
    (dict(tokens="NaN"), "usage.completion_tokens is nan, not a count"),
    (dict(tokens="Infinity"), "usage.completion_tokens is inf, not a count"),
    (dict(tokens="1e400"), "usage.completion_tokens is inf, not a count"),
    (dict(tokens="-1"), "usage.completion_tokens is -1, not a count"),
    (dict(tokens="100000"), "usage.completion_tokens is 100000, not a count of at most the 4 tokens asked"),
    (dict(accept=(1.0,), counter="NaN"), DRAFTS_SAMPLE + " is NaN, not a count"),
    (dict(accept=(1.0,), counter="+Inf"), DRAFTS_SAMPLE + " is +Inf, not a count"),
    (dict(accept=(1.0,), counter="-Inf"), DRAFTS_SAMPLE + " is -Inf, not a count"),
    (dict(accept=(1.0,), counter="-5"), DRAFTS_SAMPLE + " is -5, not a count"),
    (dict(accept=(1.0,), counter="1e400"), DRAFTS_SAMPLE + " is +Inf, not a count"),
    (dict(accept=(1.0,), counter="0.5"), DRAFTS_SAMPLE + " is 0.5, not a count"),
    (dict(accept=(1.0,), counter="1_000"), "line 4: value '1_000' is not a number"),
    (dict(accept=(1.0,), counter="many"), "line 4: value 'many' is not a number"),
    (dict(accept=(1.0,), position="100000000"), "has 2 position(s), the highest 100000000"),
    (dict(accept=(1.0,), position="9" * 5000), "has position '99999"),
    (dict(accept=(1.0,), position="\u00b2"), "has position '\u00b2', not a draft position"),
], ids=["deep-json", "tokens-list", "tokens-string", "tokens-dict", "tokens-nan", "tokens-inf", "tokens-1e400",
        "tokens-negative", "tokens-more", "counter-nan", "counter-inf", "counter-minus-inf", "counter-negative",
        "counter-1e400", "counter-fraction", "counter-underscore", "counter-many", "position-gap",
        "position-5000-digits", "position-superscript"])
def test_an_answer_smoke_cannot_use_is_one_line_of_kind_server(standin, needle):
    """Before: figures that are a list, a string, an object, NaN or infinity, a nesting deeper than the JSON
    reader's recursion, a position label that int() refuses (a superscript digit, 5,000 digits): exit 70
    (internal error); a negative count or a position 10^8 (a tuple of 10^8 floats, 800 MB) taken as figures."""
    with StandIn(**standin) as s:
        r = run("smoke", s.url, "--max-tokens", "4", "--concurrency", "1", "--timeout", "20", "--json")
    _server_line(r, needle)


def test_counters_that_go_backwards_between_reads_are_a_restart_never_a_pass():
    """The counters read after the counting prompt are below those read before it: the server restarted
    between the reads, and no acceptance can be read from them (before: "smoke passed")."""
    with StandIn(fault="restart", accept=(1.0, 0.9)) as s:
        r = run("smoke", s.url, "--max-tokens", "4", "--concurrency", "1", "--json")
    _server_line(r, "/metrics: vllm:spec_decode_num_drafts_total went from 12 to 0 between two reads: the "
                    "server restarted")


def test_a_counter_that_goes_backwards_or_vanishes_is_refused_by_the_arithmetic():
    before = sm.SpecCounters(10, 50, 20, (8, 7))
    with pytest.raises(sm.Restarted, match="num_accepted_tokens_per_pos_total at position 1 went from 7 to 0"):
        sm.SpecCounters(11, 55, 21, (9,)).minus(before)
    with pytest.raises(sm.Restarted, match="num_drafts_total went from 10 to 9"):
        sm.SpecCounters(9, 55, 21, (9, 7)).minus(before)
    with pytest.raises(sm.Restarted, match="appeared or vanished between two reads"):
        sm.counter_delta(before, None)
    assert sm.counter_delta(before, sm.SpecCounters(20, 100, 40, (16, 14, 3))) == sm.SpecCounters(10, 50, 20, (8, 7, 3))


@pytest.mark.parametrize("value", ["1", "-2.5", "1e+09", "1.79e+09", ".5", "+Inf", "-Inf", "NaN"])
def test_the_prometheus_values_of_the_text_format_are_read(value):
    assert len(sm.parse_metrics(f'x{{a="b"}} {value} 1700000000000\n')["x"]) == 1


@pytest.mark.parametrize("value", ["1_000", "0x10", "nan", "inf", "Infinity", "1e", "--1", "１"])
def test_values_outside_the_text_format_are_refused(value):
    with pytest.raises(sm.MetricsError, match="is not a number"):
        sm.parse_metrics(f"x {value}\n")


def test_the_help_states_the_limits_smoke_reads_by():
    from lucifer_shard.proof.smoke_client import MAX_BODY, MAX_LINE

    text = " ".join(run("smoke", "--help").stdout.split())
    assert f"an answer past {MAX_BODY >> 20} MiB or a stream line past {MAX_LINE >> 20} MiB" in text, text
