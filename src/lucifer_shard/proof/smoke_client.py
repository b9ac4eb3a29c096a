"""The smoke test's I/O: a running vLLM OpenAI-compatible server asked over HTTP (the standard library's
http.client: the huggingface_hub releases this tool supports bring different HTTP clients), every call
bounded by what is left of --timeout. The arithmetic and the verdict are smoke.py's."""
from __future__ import annotations

import http.client
import json
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

from ..errors import ServerError, UsageRefused
from .smoke import (FAIL, INFO, Check, Report, SpecCounters, Stream, acceptance, draft_checks, latency, model_check,
                    parse_metrics, repeat_check, spec_counters, MetricsError)

# The prompts, each after a nonce line so that no earlier request's prefix cache serves it. Counting is
# what a drafter predicts best (a healthy DSpark accepts ~100%); prose is its hardest ordinary case.
GREEDY_PROMPT = "The three laws of thermodynamics, each in one sentence:\n1."
COUNTING_PROMPT = "Count from 1 to 500, separated by commas.\n1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
PROSE_PROMPT = "Write a short story about a lighthouse keeper who finds a letter in a bottle.\n\nThe"
PROMPTS = {"counting": COUNTING_PROMPT, "prose": PROSE_PROMPT}


@dataclass(frozen=True)
class SmokeOptions:
    """smoke's command line (cli/cmd_smoke.py has the defaults and their reasons)."""

    model: str | None
    max_tokens: int
    concurrency: int
    draft_tokens: int
    expect_draft: bool
    timeout: float


class Server:
    """One base URL, every request bounded by the run's deadline."""

    def __init__(self, url: str, timeout: float):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageRefused(f"{url}: not an http(s) URL; pass the server's base URL, e.g. http://127.0.0.1:8000")
        self.base = parts.path.rstrip("/").removesuffix("/v1")  # the OpenAI client's base URL ends in /v1
        self.url = f"{parts.scheme}://{parts.netloc}{self.base}"
        self.host, self.port, self.https = parts.hostname, parts.port, parts.scheme == "https"
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.step = "connecting"

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self._timed_out()
        return left

    def _timed_out(self):
        raise ServerError(f"{self.url}: no answer within --timeout {self.timeout:g} s (at: {self.step}); a loaded or "
                          f"still-starting server may need a larger --timeout")

    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self._left())

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, http.client.HTTPResponse,
                                                                                   http.client.HTTPConnection]:
        conn = self._connection()
        try:
            conn.request(method, self.base + path, body=json.dumps(body) if body is not None else None,
                         headers={"Content-Type": "application/json", "Accept": "*/*"})
            resp = conn.getresponse()
        except (socket.timeout, TimeoutError):
            conn.close()
            self._timed_out()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            why = getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise ServerError(f"{self.url}: cannot reach the server ({why}); is it running, and is this its address "
                              f"and port?") from None
        return resp.status, resp, conn

    def get_text(self, path: str) -> tuple[int, str]:
        status, resp, conn = self.request("GET", path)
        try:
            return status, self._read(resp)
        finally:
            conn.close()

    def _read(self, resp: http.client.HTTPResponse) -> str:
        try:
            return resp.read().decode("utf-8", "replace")
        except (socket.timeout, TimeoutError):
            self._timed_out()
        except (OSError, http.client.HTTPException) as e:
            raise ServerError(f"{self.url}: the connection broke during {self.step} ({type(e).__name__}); is the "
                              f"server still running?") from None

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        status, resp, conn = self.request(method, path, body)
        try:
            text = self._read(resp)
        finally:
            conn.close()
        if status != 200:
            raise ServerError(f"{self.url}{path}: HTTP {status}: {_error_text(text)}")
        try:
            doc = json.loads(text)
        except ValueError:
            raise ServerError(f"{self.url}{path}: the answer is not JSON ({text[:60]!r}); is this an OpenAI-"
                              f"compatible vLLM server?") from None
        if not isinstance(doc, dict):
            raise ServerError(f"{self.url}{path}: the answer is JSON but not an object; not an OpenAI-compatible server")
        return doc

    def stream(self, body: dict) -> tuple[Stream, str]:
        """One streamed completion: its timings and its text."""
        t0 = time.monotonic()
        status, resp, conn = self.request("POST", "/v1/completions", {**body, "stream": True,
                                                                     "stream_options": {"include_usage": True}})
        arrivals, parts, usage = [], [], None
        try:
            if status != 200:
                raise ServerError(f"{self.url}/v1/completions: HTTP {status}: {_error_text(self._read(resp))}")
            while True:
                try:
                    raw = resp.readline()
                except (socket.timeout, TimeoutError):
                    self._timed_out()
                except (OSError, http.client.HTTPException) as e:
                    raise ServerError(f"{self.url}: the stream broke during {self.step} ({type(e).__name__}); is "
                                      f"the server still running?") from None
                if not raw:
                    break
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = _chunk(self.url, line[5:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    if choice.get("text") or choice.get("token_ids"):
                        arrivals.append(time.monotonic() - t0)
                        parts.append(choice.get("text") or "")
        finally:
            conn.close()
        if not arrivals:
            raise ServerError(f"{self.url}/v1/completions: the stream carried no token; not a vLLM completion stream")
        tokens = int((usage or {}).get("completion_tokens") or len(arrivals))
        return Stream(tuple(arrivals), tokens), "".join(parts)

    def metrics(self):
        status, text = self.get_text("/metrics")
        if status != 200:
            raise ServerError(f"{self.url}/metrics: HTTP {status}; vLLM serves its Prometheus metrics there (is "
                              f"this vLLM, started without --disable-log-stats?)")
        try:
            return parse_metrics(text)
        except MetricsError as e:
            raise ServerError(f"{self.url}/metrics: {e}; not vLLM's Prometheus metrics") from None


def _chunk(url: str, text: str) -> dict:
    try:
        doc = json.loads(text)
    except ValueError:
        raise ServerError(f"{url}/v1/completions: a stream event is not JSON ({text[:60]!r})") from None
    if not isinstance(doc, dict):
        raise ServerError(f"{url}/v1/completions: a stream event is not a JSON object")
    return doc


def _error_text(text: str) -> str:
    try:
        doc = json.loads(text)
        message = doc.get("error", {}).get("message") if isinstance(doc.get("error"), dict) else doc.get("detail")
    except (ValueError, AttributeError):
        message = None
    return " ".join(str(message or text[:120] or "(empty)").split())


def _nonced(prompt: str) -> str:
    return f"[smoke {secrets.token_hex(6)}]\n{prompt}"


def _request(model: str, prompt: str, max_tokens: int) -> dict:
    # ignore_eos (vLLM's): every request decodes max_tokens, so the rates compare run to run
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def identify(server: Server, expected: str | None) -> tuple[str, str, Check]:
    """vLLM's version (GET /version, vLLM's own endpoint), the model to use and the models check."""
    server.step = "GET /version"
    status, text = server.get_text("/version")
    try:
        version = json.loads(text).get("version") if status == 200 else None
    except (ValueError, AttributeError):
        version = None
    server.step = "GET /v1/models"
    doc = server.json("GET", "/v1/models")
    data = doc.get("data")
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise ServerError(f"{server.url}/v1/models: no list of models ('data' with ids); not an OpenAI-compatible "
                          f"server")
    if not isinstance(version, str):
        raise ServerError(f"{server.url}: answers /v1/models but not vLLM's /version (HTTP {status}); smoke reads "
                          f"vLLM's metrics and options, so point it at a vLLM server")
    served = [m["id"] for m in data]
    check = model_check(served, expected)
    return version, expected or (served[0] if served else ""), check


def run(url: str, options: SmokeOptions, log: Callable[[str], None]) -> Report:
    """Every step against the server at `url`, each announced to `log`; the report (smoke.py's checks)."""
    server = Server(url, options.timeout)
    version, model, models = identify(server, options.model)
    report = Report(server.url, version, model, [models])
    if models.status == FAIL:
        return report
    server.step = "greedy repeat"
    log(f"greedy repeat: {options.max_tokens} tokens, twice")
    # return_token_ids (vLLM's): the ids too, so that a server without a tokenizer is compared on them
    body = {**_request(model, _nonced(GREEDY_PROMPT), options.max_tokens), "return_token_ids": True}
    first, second = (server.json("POST", "/v1/completions", body) for _ in range(2))
    texts = [_completion(server, d) for d in (first, second)]
    report.checks.append(repeat_check(texts[0], texts[1], int((first.get("usage") or {}).get("completion_tokens") or 0)))
    for c in sorted({1, options.concurrency}):
        server.step = f"latency at concurrency {c}"
        log(f"latency: {c} streamed request(s) of {options.max_tokens} tokens")
        bodies = [_request(model, _nonced(GREEDY_PROMPT), options.max_tokens) for _ in range(c)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(c) as pool:
            streams = [s for s, _ in pool.map(server.stream, bodies)]
        lat = latency(c, time.monotonic() - t0, streams)
        report.latency.append(lat)
        report.checks.append(Check("latency", INFO, lat.line()))
    server.step = "GET /metrics"
    if spec_counters(server.metrics()) is None:
        report.checks += draft_checks(None, None, options.expect_draft)
        return report
    for name, prompt in PROMPTS.items():
        server.step = f"draft acceptance, {name} prompt"
        log(f"draft acceptance: the {name} prompt, {options.draft_tokens} tokens")
        before = spec_counters(server.metrics())
        server.json("POST", "/v1/completions", _request(model, _nonced(prompt), options.draft_tokens))
        after = spec_counters(server.metrics())
        report.acceptance.append(acceptance(name, after.minus(before) if after and before else SpecCounters(0, 0, 0, ())))
    report.checks += draft_checks(*report.acceptance, options.expect_draft)
    return report


def _completion(server: Server, doc: dict) -> str:
    """A completion's output: its text, and its token ids where the server returns them (a server without a
    tokenizer returns ids only)."""
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ServerError(f"{server.url}/v1/completions: no choices in the answer; not an OpenAI-compatible server")
    return f"{choices[0].get('text', '')}{choices[0].get('token_ids') or ''}"
