"""`lucifer-shard smoke`: the pure parts (Prometheus text, acceptance from counter deltas, the verdict) and
the error paths, against a stand-in server (tests/vllmstandin.py). Against vLLM's own server:
tests/forward/test_smoke_server.py."""
from __future__ import annotations

import json
import math
import socket

import pytest

from lucifer_shard.errors import ERROR_KINDS
from lucifer_shard.proof import smoke as sm

from helpers import run
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
    bad = sm.repeat_check("the cat", "the dog", 2)
    assert bad.status == sm.FAIL and "from character 4" in bad.detail and "'cat' vs 'dog'" in bad.detail


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


@pytest.mark.parametrize("standin,args,failed", [
    (dict(accept=(0.5, 0.25)), (), "drafter: first-position acceptance 0.50 on the counting prompt, below 0.90"),
    (dict(fault="random"), (), "greedy repeat: the same greedy request gave two outputs"),
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
