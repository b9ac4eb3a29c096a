"""The smoke test's I/O: a running vLLM OpenAI-compatible server asked over HTTP (the standard library's
http.client: the huggingface_hub releases this tool supports bring different HTTP clients). The whole run
has one deadline, --timeout from its start, which cuts any request still open when it passes (a socket
timeout bounds each read, which a server dripping a byte a second never trips); every answer is read in
bounded memory (MAX_BODY, MAX_LINE). The arithmetic and the verdict are smoke.py's."""
from __future__ import annotations

import http.client
import json
import reprlib
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, NoReturn
from urllib.parse import urlsplit

from ..errors import COMMAND_AGAIN, ServerError, UsageRefused
from .smoke import (FAIL, INFO, Check, MetricsError, Report, Restarted, SpecCounters, Stream, acceptance,
                    counter_delta, draft_checks, latency, model_check, parse_metrics, repeat_check, spec_counters)

# What smoke reads at most. The largest answer it asks for is a completion of 4096 tokens (--max-tokens'
# cap) with their ids, about 100 KB, or vLLM's /metrics, some 100 KB; a stream event is one token's chunk,
# a few hundred bytes beside the model's name. Ten to a hundred times those, and no more held at once.
MAX_BODY = 8 << 20
MAX_LINE = 1 << 20
READ = 64 << 10  # one read: what arrives, up to this

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
    """One base URL, every request cut at the run's deadline."""

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

    def _too_large(self, path: str, what: str, limit: int) -> NoReturn:
        raise ServerError(f"{self.url}{path}: {what} {limit >> 20} MiB (smoke reads at most that); not an answer of "
                          f"a vLLM OpenAI-compatible server")

    def get_text(self, path: str) -> tuple[int, str]:
        with _Exchange(self, "GET", path) as ex:
            return ex.status, ex.text()

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        with _Exchange(self, method, path, body) as ex:
            status, text = ex.status, ex.text()
        if status != 200:
            raise ServerError(f"{self.url}{path}: HTTP {status}: {_error_text(text)}")
        doc = _decoded(text)
        if doc is None:
            raise ServerError(f"{self.url}{path}: the answer is not JSON ({text[:60]!r}); is this an OpenAI-"
                              f"compatible vLLM server?")
        if not isinstance(doc, dict):
            raise ServerError(f"{self.url}{path}: the answer is JSON but not an object; not an OpenAI-compatible server")
        return doc

    def stream(self, body: dict) -> Stream:
        """One streamed completion's timings."""
        t0 = time.monotonic()
        where, asked = f"{self.url}/v1/completions", body["max_tokens"]
        arrivals, tokens = [], None
        with _Exchange(self, "POST", "/v1/completions",
                       {**body, "stream": True, "stream_options": {"include_usage": True}}) as ex:
            if ex.status != 200:
                raise ServerError(f"{where}: HTTP {ex.status}: {_error_text(ex.text())}")
            for raw in ex.lines():
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = _chunk(where, line[5:])
                tokens = _tokens(where, chunk.get("usage"), asked, tokens)
                choices = chunk.get("choices") or []
                if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
                    raise ServerError(f"{where}: a stream event's choices are not a list of objects; not vLLM's "
                                      f"completion stream")
                arrivals += [time.monotonic() - t0 for c in choices if c.get("text") or c.get("token_ids")]
                if len(arrivals) > asked:  # each event carries a token at least: more is no answer to this request
                    raise ServerError(f"{where}: the stream carried more than the {asked} tokens asked; not vLLM's "
                                      f"completion stream")
        if not arrivals:
            raise ServerError(f"{where}: the stream carried no token; not a vLLM completion stream")
        return Stream(tuple(arrivals), tokens or len(arrivals))

    def counters(self) -> SpecCounters | None:
        """The spec-decode counters at /metrics, or None where the server does not draft."""
        status, text = self.get_text("/metrics")
        if status != 200:
            raise ServerError(f"{self.url}/metrics: HTTP {status}; vLLM serves its Prometheus metrics there (is "
                              f"this vLLM, started without --disable-log-stats?)")
        try:
            return spec_counters(parse_metrics(text))
        except MetricsError as e:
            raise ServerError(f"{self.url}/metrics: {e}; not vLLM's Prometheus metrics") from None


class _Exchange:
    """One request and its answer on a connection of its own, shut down by a timer when the run's deadline
    passes: however its server drips or streams, no read outlives --timeout. Its body arrives in reads of
    what is there (read1), so the deadline and the caps are checked as it comes."""

    def __init__(self, server: Server, method: str, path: str, body: dict | None = None):
        self.server, self.path = server, path
        self.cut = False  # the deadline shut the socket: whatever a read then says, the run timed out
        self._lock = threading.Lock()  # close and cut never overlap: a closed socket's number may be reused
        self._closed = False
        cls = http.client.HTTPSConnection if server.https else http.client.HTTPConnection
        self.conn = cls(server.host, server.port, timeout=server._left())
        self._timer = threading.Timer(server._left(), self._cut)
        self._timer.daemon = True
        self._timer.start()
        try:
            self.conn.connect()
            if self.cut:  # it fired before there was a socket to shut down (a name lookup it cannot interrupt)
                raise TimeoutError
            self.conn.request(method, server.base + path, body=json.dumps(body) if body is not None else None,
                              headers={"Content-Type": "application/json", "Accept": "*/*"})
            self.resp = self.conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            self.close()
            if self.cut or isinstance(e, TimeoutError):
                server._timed_out()
            why = getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise ServerError(f"{server.url}: cannot reach the server ({why}); is it running, and is this its "
                              f"address and port?") from None
        except BaseException:
            self.close()
            raise
        self.status = self.resp.status

    def __enter__(self) -> "_Exchange":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._timer.cancel()
        self.conn.close()

    def _cut(self) -> None:
        with self._lock:
            if self._closed:
                return
            self.cut = True
            sock = self.conn.sock  # the raw socket during a TLS handshake too
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # a blocked read returns; close stays the owner's
                except OSError:
                    pass

    def _chunks(self) -> Iterator[bytes]:
        """The body as it arrives; the run's timeout once the deadline cut it."""
        while True:
            try:
                data = self.resp.read1(READ)
            except (OSError, http.client.HTTPException) as e:
                if self.cut or isinstance(e, TimeoutError):
                    self.server._timed_out()
                raise ServerError(f"{self.server.url}: the connection broke during {self.server.step} "
                                  f"({type(e).__name__}); is the server still running?") from None
            if self.cut:
                self.server._timed_out()
            if not data:
                if self.resp.length:  # it declared more than it sent
                    raise ServerError(f"{self.server.url}: the connection broke during {self.server.step} (the "
                                      f"answer ended {self.resp.length} bytes short); is the server still running?")
                return
            yield data

    def text(self) -> str:
        """The whole body, refused past MAX_BODY (a declared length at once)."""
        if (self.resp.length or 0) > MAX_BODY:
            self.server._too_large(self.path, "the answer is larger than", MAX_BODY)
        parts, size = [], 0
        for data in self._chunks():
            size += len(data)
            if size > MAX_BODY:
                self.server._too_large(self.path, "the answer is larger than", MAX_BODY)
            parts.append(data)
        return b"".join(parts).decode("utf-8", "replace")

    def lines(self) -> Iterator[bytes]:
        """The body's lines as they arrive, each refused past MAX_LINE."""
        rest = b""
        for data in self._chunks():
            *done, rest = (rest + data).split(b"\n")
            if len(rest) > MAX_LINE or any(len(line) > MAX_LINE for line in done):
                self.server._too_large(self.path, "a stream line is longer than", MAX_LINE)
            yield from done
        if rest:
            yield rest


def _decoded(text: str):
    """`text` as JSON, or None where it is not (a nesting deeper than the reader's recursion included)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _tokens(where: str, usage, asked: int, default: int | None) -> int | None:
    """usage.completion_tokens of an answer, or `default` without one: a count of at most the tokens asked."""
    if usage is None:
        return default
    if not isinstance(usage, dict):
        raise ServerError(f"{where}: usage is {reprlib.repr(usage)}, not an object; not vLLM's answer")
    n = usage.get("completion_tokens")
    if n is None:
        return default
    if type(n) is not int or not 0 <= n <= asked:
        raise ServerError(f"{where}: usage.completion_tokens is {reprlib.repr(n)}, not a count of at most the {asked} "
                          f"tokens asked; not vLLM's answer")
    return n


def _chunk(where: str, text: str) -> dict:
    doc = _decoded(text)
    if doc is None:
        raise ServerError(f"{where}: a stream event is not JSON ({text[:60]!r})")
    if not isinstance(doc, dict):
        raise ServerError(f"{where}: a stream event is not a JSON object")
    return doc


def _error_text(text: str) -> str:
    try:
        doc = _decoded(text)
        message = doc.get("error", {}).get("message") if isinstance(doc.get("error"), dict) else doc.get("detail")
    except AttributeError:
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
    doc = _decoded(text) if status == 200 else None
    version = doc.get("version") if isinstance(doc, dict) else None
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
    tokens = _tokens(f"{server.url}/v1/completions", first.get("usage"), options.max_tokens, 0)
    report.checks.append(repeat_check(texts[0], texts[1], tokens))
    for c in sorted({1, options.concurrency}):
        server.step = f"latency at concurrency {c}"
        log(f"latency: {c} streamed request(s) of {options.max_tokens} tokens")
        bodies = [_request(model, _nonced(GREEDY_PROMPT), options.max_tokens) for _ in range(c)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(c) as pool:
            streams = list(pool.map(server.stream, bodies))
        lat = latency(c, time.monotonic() - t0, streams)
        report.latency.append(lat)
        report.checks.append(Check("latency", INFO, lat.line()))
    server.step = "GET /metrics"
    if server.counters() is None:
        report.checks += draft_checks(None, None, options.expect_draft)
        return report
    for name, prompt in PROMPTS.items():
        server.step = f"draft acceptance, {name} prompt"
        log(f"draft acceptance: the {name} prompt, {options.draft_tokens} tokens")
        before = server.counters()
        server.json("POST", "/v1/completions", _request(model, _nonced(prompt), options.draft_tokens))
        after = server.counters()
        try:
            delta = counter_delta(before, after)
        except Restarted as e:  # a restart between the reads: the deltas would be nonsense, never a pass
            raise ServerError(f"{server.url}/metrics: {e}",
                              remedy=COMMAND_AGAIN.at(command="smoke").after("wait until the server stays up")) from None
        report.acceptance.append(acceptance(name, delta))
    report.checks += draft_checks(*report.acceptance, options.expect_draft)
    return report


def _completion(server: Server, doc: dict) -> str:
    """A completion's output: its text, and its token ids where the server returns them (a server without a
    tokenizer returns ids only)."""
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ServerError(f"{server.url}/v1/completions: no choices in the answer; not an OpenAI-compatible server")
    return f"{choices[0].get('text', '')}{choices[0].get('token_ids') or ''}"
