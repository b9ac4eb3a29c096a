"""A stand-in for a vLLM OpenAI-compatible server on 127.0.0.1, for `lucifer-shard smoke`'s CPU tests: its
error paths (an answer that is not JSON, not vLLM, too slow) and the conventions every command follows. The
real proof runs against vLLM's own server (tests/forward/test_smoke_server.py); this serves only what smoke
reads, in vLLM's shapes:

    GET  /version                {"version": ...}
    GET  /v1/models              {"data": [{"id": MODEL, "owned_by": "vllm"}]}
    POST /v1/completions         deterministic text from the prompt; stream: one SSE event per token,
                                 then usage, then [DONE]
    GET  /metrics                Prometheus text; with `accept` (per-position acceptance), the spec-decode
                                 counters, advanced by each request as a drafter accepting that much would

`fault` plants one failure: "random" (each answer differs), "not_json" (/v1/models is HTML), "not_vllm"
(no /version), "slow" (every answer waits `delay` seconds), "bad_metrics" (/metrics is not Prometheus text).
The hostile ones (issue 61, class F), each ending when the client goes or the stand-in closes:
"drip_head" (/version's whole answer, status line first, one byte every `delay` s), "drip_body" (/version's
headers at once, then its body a byte every `delay` s), "endless_stream" (a stream that sends the tokens
asked, then a keep-alive comment every 50 ms, never [DONE]), "token_flood" (a stream of tokens that never
stops), "huge" (the answer at `at` is a JSON document of `size` bytes, sent without a length), "huge_line"
(a stream whose first line is `size` bytes), "deep" (the answer at `at` is 1,000,000 nested arrays),
"restart" (the counters start again from zero at the third /metrics read, as a restarted server's).
`tokenizer=False` answers as vLLM started with --skip-tokenizer-init: a text prompt HTTP 400 with vLLM's
message, a prompt of token ids with ids only (empty text). `spare` streams are served whole before a stream
fault applies. `tokens` is written as the raw JSON of
every `usage.completion_tokens`; `counter` as the value text of the drafts counter; `position` as the label
of one more per-position sample.
"""
from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "standin/flash-tp3"


class StandIn:
    def __init__(self, fault: str | None = None, accept: tuple[float, ...] | None = None, delay: float = 0.0,
                 at: str = "/v1/models", size: int = 0, spare: int = 0, tokens: str | None = None,
                 counter: str | None = None, position: str | None = None, tokenizer: bool = True):
        self.fault, self.accept, self.delay, self.tokenizer = fault, accept, delay, tokenizer
        self.at, self.size, self.spare, self.raw_tokens, self.counter, self.position = (at, size, spare, tokens,
                                                                                        counter, position)
        self.streams = self.metrics_reads = 0
        self.closing = threading.Event()  # a hostile answer's loop ends when it is set
        self.counters = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0,
                         "per_pos": [0.0] * len(accept or ())}
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # a client gone (smoke's --timeout) is no news
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "StandIn":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()

    def tokens(self, prompt: str | list[int], n: int) -> list[str]:
        salt = secrets.token_hex(2) if self.fault == "random" else ""
        seed = sum(prompt) if isinstance(prompt, list) else sum(map(ord, prompt))
        return [f" w{(seed + i * 7) % 97}{salt}" for i in range(n)]

    def choice(self, words: list[str]) -> dict:
        """A completion choice of `words`: their text, or without a tokenizer their ids alone (a word's number)."""
        if self.tokenizer:
            return {"index": 0, "text": "".join(words)}
        return {"index": 0, "text": "", "token_ids": [int(w.split("w")[1]) for w in words]}

    def draft(self, n: int) -> None:
        """Advance the counters as a drafter of `self.accept` would over `n` target steps."""
        if not self.accept:
            return
        with self.lock:
            c = self.counters
            c["drafts"] += n
            c["draft_tokens"] += n * len(self.accept)
            for i, rate in enumerate(self.accept):
                c["per_pos"][i] += round(n * rate)
            c["accepted"] = sum(c["per_pos"])

    def metrics(self) -> str:
        with self.lock:
            self.metrics_reads += 1
            if self.fault == "restart" and self.metrics_reads == 3:
                self.counters = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0,
                                 "per_pos": [0.0] * len(self.accept or ())}
        lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                 "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0']
        if self.accept:
            c, label = self.counters, f'engine="0",model_name="{MODEL}"'
            lines += [f"vllm:spec_decode_num_drafts_total{{{label}}} {self.counter or c['drafts']}",
                      f"vllm:spec_decode_num_draft_tokens_total{{{label}}} {c['draft_tokens']}",
                      f"vllm:spec_decode_num_accepted_tokens_total{{{label}}} {c['accepted']}"]
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{i}"}} {v}'
                      for i, v in enumerate(c["per_pos"])]
            if self.position is not None:
                lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{self.position}"}} 1.0')
        return "\n".join(lines) + "\n"

    def _usage(self, n: int) -> str:
        """The usage object's JSON, its completion_tokens as planted (`tokens`)."""
        return f'{{"prompt_tokens": 9, "completion_tokens": {self.raw_tokens or n}, "total_tokens": {9 + n}}}'

    def _hostile(self, path: str) -> bool:
        """Whether the fault at `path` is a hostile one for this request (a stream fault spares `spare` streams)."""
        if self.fault in ("drip_head", "drip_body"):
            return path == "/version"
        if self.fault in ("huge", "deep"):
            return path == self.at
        if self.fault in ("endless_stream", "token_flood", "huge_line") and path == "stream":
            with self.lock:
                self.streams += 1
                return self.streams > self.spare
        return False

    def _handler(self):
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet: pytest shows failures, not every request
                pass

            def send(self, status: int, body: str, kind: str = "application/json") -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def drip(self, data: bytes) -> None:
                """`data` a byte every `delay` seconds, until it is sent, the client goes or the stand-in closes."""
                for i in range(len(data)):
                    if standin.closing.wait(standin.delay):
                        return
                    self.wfile.write(data[i:i + 1])
                    self.wfile.flush()

            def pour(self, head: bytes, size: int, fill: bytes, tail: bytes = b"") -> None:
                """`head`, then `fill` repeated to `size` bytes in 1 MiB writes, then `tail`: a large answer
                without holding it (the writes stop with the client)."""
                self.wfile.write(head)
                block = fill * ((1 << 20) // len(fill))
                for _ in range(size // len(block)):
                    if standin.closing.is_set():
                        return
                    self.wfile.write(block)
                self.wfile.write(tail)

            def hostile_get(self) -> None:
                version = json.dumps({"version": "0.0.0-standin"}).encode()
                if standin.fault == "drip_head":
                    self.drip(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                              + str(len(version)).encode() + b"\r\n\r\n" + version)
                elif standin.fault == "drip_body":
                    body = version[:-1] + b" " * 1000 + b"}"
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.flush()
                    self.drip(body)
                elif standin.fault == "huge":  # no Content-Length: the answer ends with the connection
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.pour(b'{"data": [', standin.size, b'{"id": "m"}, ', b'{"id": "m"}]}')
                else:  # deep
                    self.send(200, "[" * 1_000_000)

            def do_GET(self) -> None:
                time.sleep(standin.delay if standin.fault == "slow" else 0)
                if standin._hostile(self.path):
                    self.hostile_get()
                elif self.path == "/version" and standin.fault != "not_vllm":
                    self.send(200, json.dumps({"version": "0.0.0-standin"}))
                elif self.path == "/v1/models":
                    if standin.fault == "not_json":
                        self.send(200, "<html>a web page</html>", "text/html")
                    else:
                        self.send(200, json.dumps({"object": "list", "data": [{"id": MODEL, "owned_by": "vllm"}]}))
                elif self.path == "/metrics":
                    self.send(200, "{not: prometheus}" if standin.fault == "bad_metrics" else standin.metrics(),
                              "text/plain")
                else:
                    self.send(404, json.dumps({"detail": "Not Found"}))

            def event(self, doc: dict) -> None:
                self.wfile.write(f"data: {json.dumps(doc)}\n\n".encode())
                self.wfile.flush()

            def hostile_stream(self, words: list[str]) -> None:
                if standin.fault == "huge_line":
                    self.pour(b'data: {"choices": [{"index": 0, "text": "', standin.size, b"x" * 64, b'"}]}\n\n')
                    return
                for w in words:
                    self.event({"choices": [{"index": 0, "text": w}]})
                while not standin.closing.wait(0.05 if standin.fault == "endless_stream" else 0.001):
                    if standin.fault == "endless_stream":
                        self.wfile.write(b": keep-alive\n\n")
                        self.wfile.flush()
                    else:
                        self.event({"choices": [{"index": 0, "text": " more"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions" or body.get("model") != MODEL:
                    self.send(404, json.dumps({"error": {"message": f"The model `{body.get('model')}` does not exist."}}))
                    return
                if standin._hostile(self.path):
                    self.hostile_get()
                    return
                if isinstance(body["prompt"], str) and not standin.tokenizer:  # vLLM 0.34.0's renderers/base.py
                    self.send(400, json.dumps({"error": {"message": "Tokenizer not available when "
                                                                    "`skip_tokenizer_init=True`", "code": 400}}))
                    return
                words = standin.tokens(body["prompt"], int(body["max_tokens"]))
                standin.draft(len(words))
                usage = standin._usage(len(words))
                if not body.get("stream"):
                    self.send(200, f'{{"choices": [{json.dumps(standin.choice(words))}], "usage": {usage}}}')
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                if standin._hostile("stream"):
                    self.hostile_stream(words)
                    return
                for w in words:
                    time.sleep(0.001)
                    self.event({"choices": [standin.choice([w])]})
                self.wfile.write(f'data: {{"choices": [], "usage": {usage}}}\n\ndata: [DONE]\n\n'.encode())

        return Handler
