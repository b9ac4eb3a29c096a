"""The smoke test's I/O: a running vLLM OpenAI-compatible server asked over HTTP through httpx2 (the client
huggingface_hub brings, which source/hub.py uses too), its completion streams read by httpx2's EventSource.
The whole run has one deadline, --timeout from its start, which cuts any request still open when it passes
(httpx2's timeouts bound each read, which a server dripping a byte a second never trips: a timer shuts the
request's socket down, found through httpcore's `trace` extension); every answer is read in bounded memory
(MAX_BODY, MAX_LINE). The arithmetic and the verdict are smoke.py's."""
from __future__ import annotations

import json
import random
import reprlib
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, NoReturn
from urllib.parse import urlsplit

import httpx2

from .. import stops
from ..errors import COMMAND_AGAIN, ServerError, UsageRefused
from .smoke import (FAIL, INFO, Check, MetricsError, Report, Restarted, SpecCounters, Stream, acceptance,
                    counter_delta, draft_checks, latency, model_check, parse_metrics, repeat_check, spec_counters)

# What smoke reads at most. The largest answer it asks for is a completion of 4096 tokens (--max-tokens'
# cap) with their ids, about 100 KB, or vLLM's /metrics, some 100 KB; a stream event is one token's chunk,
# a few hundred bytes beside the model's name. Ten to a hundred times those, and no more held at once.
MAX_BODY = 8 << 20
MAX_LINE = 1 << 20

# The prompts, each after a nonce line so that no earlier request's prefix cache serves it. Counting is
# what a drafter predicts best (a healthy DSpark accepts ~100%); prose is its hardest ordinary case.
GREEDY_PROMPT = "The three laws of thermodynamics, each in one sentence:\n1."
COUNTING_PROMPT = "Count from 1 to 500, separated by commas.\n1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
PROSE_PROMPT = "Write a short story about a lighthouse keeper who finds a letter in a bottle.\n\nThe"
PROMPTS = {"counting": COUNTING_PROMPT, "prose": PROSE_PROMPT}
# Token-id prompts, for a server without a tokenizer (vLLM's --skip-tokenizer-init, as every server of the GPU
# harness: its synthetic checkpoint has none), which answers a text prompt HTTP 400 and takes `prompt` as a
# list of ids. The ids lie in [ID_LO, ID_HI): above DeepSeek-V4's BOS and EOS (0, 1), inside its vocabulary
# (129,280) and the test models' (1,000). The counting prompt's analogue is a cycle of ids repeated: a target
# continues a repeated sequence by copying it, which a drafter predicts as it predicts counting.
ID_LO, ID_HI = 2, 1000
CYCLE, REPEATS = 16, 6
PROMPT_MODES = ("auto", "text", "tokens")


def _ids(seed: str, n: int) -> list[int]:
    """`n` ids in [ID_LO, ID_HI), the same for the same seed (each prompt's body is fixed, as a text's)."""
    rng = random.Random(seed)
    return [rng.randrange(ID_LO, ID_HI) for _ in range(n)]


TOKEN_PROMPTS = {"repeating ids": _ids("cycle", CYCLE) * REPEATS, "random ids": _ids("random", CYCLE * REPEATS)}
TOKEN_GREEDY = _ids("greedy", 48)


@dataclass(frozen=True)
class SmokeOptions:
    """smoke's command line (cli/cmd_smoke.py has the defaults and their reasons)."""

    model: str | None
    max_tokens: int
    concurrency: int
    draft_tokens: int
    expect_draft: bool
    timeout: float
    prompts: str = "auto"  # PROMPT_MODES: auto tries text, then token ids where the server refuses text
    batch_invariant: bool = False  # the server runs with VLLM_BATCH_INVARIANT=1: a greedy repeat that differs fails
    started: float | None = None  # time.monotonic() when the command began: --timeout counts from it (default: now)


class Refused(ServerError):
    """An HTTP status other than 200, kept for the caller that can try another way (a text prompt refused)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class Server:
    """One base URL, every request cut at the run's deadline."""

    def __init__(self, url: str, timeout: float, started: float | None = None):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageRefused(f"{url}: not an http(s) URL; pass the server's base URL, e.g. http://127.0.0.1:8000")
        self.base = parts.path.rstrip("/").removesuffix("/v1")  # the OpenAI client's base URL ends in /v1
        self.url = f"{parts.scheme}://{parts.netloc}{self.base}"
        # one connection a request (no keep-alive), so that each request's socket is its own to cut; no proxy
        # from the environment, which would stand between smoke and the server it times; certificates loaded
        # for https only (half a second of the run's start, for a plain http URL that has no use for them)
        self.client = httpx2.Client(trust_env=False, verify=parts.scheme == "https",
                                    limits=httpx2.Limits(max_keepalive_connections=0))
        self.timeout = timeout
        self.deadline = (time.monotonic() if started is None else started) + timeout
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
            raise Refused(f"{self.url}{path}: HTTP {status}: {_error_text(text)}", status)
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
            for data in ex.events():
                if data == "[DONE]":
                    continue
                chunk = _chunk(where, data)
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
    """One request and its answer on a connection of its own, whose socket a timer shuts down when the run's
    deadline passes: however its server drips or streams, no read outlives --timeout. Its body arrives in
    reads of what is there (httpx2's iter_raw, without content decoding), so the deadline and the caps are
    checked as it comes."""

    def __init__(self, server: Server, method: str, path: str, body: dict | None = None):
        self.server, self.path = server, path
        self.cut = False  # the deadline shut the socket: whatever a read then says, the run timed out
        self._lock = threading.Lock()  # cut never touches a socket the request has let go
        self._closed = False
        self._sock: socket.socket | None = None
        self.resp: httpx2.Response | None = None
        self._timer = threading.Timer(server._left(), self._cut)
        self._timer.daemon = True
        self._timer.start()
        try:
            request = server.client.build_request(
                method, server.url + path, json=body, timeout=httpx2.Timeout(server._left()),
                headers={"Accept": "*/*", "Accept-Encoding": "identity"}, extensions={"trace": self._trace})
            self.resp = server.client.send(request, stream=True)
        except httpx2.HTTPError as e:
            self.close()
            if self.cut or isinstance(e, httpx2.TimeoutException):
                server._timed_out()
            why = str(e) or type(e).__name__
            raise ServerError(f"{server.url}: cannot reach the server ({why}); is it running, and is this its "
                              f"address and port?") from None
        except BaseException:
            self.close()
            raise
        self.status = self.resp.status_code

    def __enter__(self) -> "_Exchange":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._timer.cancel()
        if self.resp is not None:
            self.resp.close()

    def _trace(self, event: str, info: dict) -> None:
        """httpcore's trace hook: the request's socket, once connected; cut at once if the deadline already
        passed (a name lookup or connect that took longer, which no timer can interrupt)."""
        if event == "connection.connect_tcp.complete":
            with self._lock:
                self._sock = info["return_value"].get_extra_info("socket")
                if self.cut:
                    self._shutdown()

    def _cut(self) -> None:
        with self._lock:
            if self._closed:
                return
            self.cut = True
            self._shutdown()

    def _shutdown(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # a blocked read returns; close stays httpx2's
            except OSError:
                pass

    def _broke(self, e: Exception) -> NoReturn:
        if self.cut or isinstance(e, httpx2.TimeoutException):
            self.server._timed_out()
        raise ServerError(f"{self.server.url}: the connection broke during {self.server.step} ({type(e).__name__}: "
                          f"{e}); is the server still running?") from None

    def _each(self, items: Iterator) -> Iterator:
        """`items` as they come, the run's timeout once the deadline cut them; a broken connection one line."""
        while True:
            try:
                item = next(items)
            except StopIteration:
                break
            except httpx2.SSEError:  # an event past its bound: events() says so
                raise
            except httpx2.HTTPError as e:
                self._broke(e)
            if self.cut:
                self.server._timed_out()
            stops.check()
            yield item
        if self.cut:  # a shut socket can read as the body's end
            self.server._timed_out()

    def text(self) -> str:
        """The whole body, refused past MAX_BODY (a declared length at once)."""
        declared = self.resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY:
            self.server._too_large(self.path, "the answer is larger than", MAX_BODY)
        parts, size = [], 0
        for data in self._each(self.resp.iter_raw()):
            size += len(data)
            if size > MAX_BODY:
                self.server._too_large(self.path, "the answer is larger than", MAX_BODY)
            parts.append(data)
        return b"".join(parts).decode("utf-8", "replace")

    def events(self) -> Iterator[str]:
        """The data of each server-sent event as it arrives (httpx2's EventSource), an event refused past
        MAX_LINE while it is still arriving."""
        kind = self.resp.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != "text/event-stream":
            raise ServerError(f"{self.server.url}{self.path}: the stream's content type is {kind or 'none'!r}, not "
                              f"text/event-stream; not vLLM's completion stream")
        try:
            yield from (event.data for event in self._each(iter(httpx2.EventSource(self.resp, max_event_size=MAX_LINE))))
        except httpx2.SSEError:  # the content type was checked above: what is left is the size bound
            self.server._too_large(self.path, "a stream line is longer than", MAX_LINE)


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


def _nonced(prompt: str | list[int]) -> str | list[int]:
    """`prompt` after a random nonce (a line of text, or four ids), so no earlier request's prefix cache serves it."""
    if isinstance(prompt, list):
        return [ID_LO + secrets.randbelow(ID_HI - ID_LO) for _ in range(4)] + prompt
    return f"[smoke {secrets.token_hex(6)}]\n{prompt}"


def _request(model: str, prompt: str | list[int], max_tokens: int) -> dict:
    # ignore_eos (vLLM's): every request decodes max_tokens, so the rates compare run to run; return_token_ids
    # (vLLM's): the ids too, the only output of a server without a tokenizer (its text is empty)
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


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


def _greedy_pair(server: Server, model: str, mode: str, max_tokens: int) -> tuple[dict, dict, str]:
    """The greedy request sent twice, as text or token ids (`mode`; auto: text, then token ids where the server
    refuses text with HTTP 400, as one without a tokenizer does); both answers and the prompts used, in words."""
    if mode != "tokens":
        body = _request(model, _nonced(GREEDY_PROMPT), max_tokens)
        try:
            first = server.json("POST", "/v1/completions", body)
            return first, server.json("POST", "/v1/completions", body), "text"
        except Refused as e:
            if mode == "text" or e.status != 400:
                raise
            why = f"token ids (the server refused a text prompt: {e}; a server started with --skip-tokenizer-init has no tokenizer)"
    else:
        why = "token ids (--prompts tokens)"
    body = _request(model, _nonced(TOKEN_GREEDY), max_tokens)
    return server.json("POST", "/v1/completions", body), server.json("POST", "/v1/completions", body), why


def run(url: str, options: SmokeOptions, log: Callable[[str], None]) -> Report:
    """Every step against the server at `url`, each announced to `log`; the report (smoke.py's checks)."""
    server = Server(url, options.timeout, options.started)
    try:
        return _run(server, options, log)
    finally:
        server.client.close()


def _run(server: Server, options: SmokeOptions, log: Callable[[str], None]) -> Report:
    version, model, models = identify(server, options.model)
    report = Report(server.url, version, model, [models])
    if models.status == FAIL:
        return report
    server.step = "greedy repeat"
    log(f"greedy repeat: {options.max_tokens} tokens, twice")
    first, second, report.prompts = _greedy_pair(server, model, options.prompts, options.max_tokens)
    tokens_mode = report.prompts != "text"
    greedy, drafting = (TOKEN_GREEDY, TOKEN_PROMPTS) if tokens_mode else (GREEDY_PROMPT, PROMPTS)
    texts = [_completion(server, d) for d in (first, second)]
    tokens = _tokens(f"{server.url}/v1/completions", first.get("usage"), options.max_tokens, 0)
    report.checks.append(repeat_check(texts[0], texts[1], tokens, options.batch_invariant))
    for c in sorted({1, options.concurrency}):
        server.step = f"latency at concurrency {c}"
        log(f"latency: {c} streamed request(s) of {options.max_tokens} tokens")
        bodies = [_request(model, _nonced(greedy), options.max_tokens) for _ in range(c)]
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
    for name, prompt in drafting.items():
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
