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
"""
from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "standin/flash-tp3"


class StandIn:
    def __init__(self, fault: str | None = None, accept: tuple[float, ...] | None = None, delay: float = 0.0):
        self.fault, self.accept, self.delay = fault, accept, delay
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
        self.server.shutdown()
        self.server.server_close()

    def tokens(self, prompt: str, n: int) -> list[str]:
        salt = secrets.token_hex(2) if self.fault == "random" else ""
        return [f" w{(sum(map(ord, prompt)) + i * 7) % 97}{salt}" for i in range(n)]

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
        lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                 "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0']
        if self.accept:
            c, label = self.counters, f'engine="0",model_name="{MODEL}"'
            lines += [f"vllm:spec_decode_num_drafts_total{{{label}}} {c['drafts']}",
                      f"vllm:spec_decode_num_draft_tokens_total{{{label}}} {c['draft_tokens']}",
                      f"vllm:spec_decode_num_accepted_tokens_total{{{label}}} {c['accepted']}"]
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{i}"}} {v}'
                      for i, v in enumerate(c["per_pos"])]
        return "\n".join(lines) + "\n"

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

            def do_GET(self) -> None:
                time.sleep(standin.delay if standin.fault == "slow" else 0)
                if self.path == "/version" and standin.fault != "not_vllm":
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

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions" or body.get("model") != MODEL:
                    self.send(404, json.dumps({"error": {"message": f"The model `{body.get('model')}` does not exist."}}))
                    return
                words = standin.tokens(body["prompt"], int(body["max_tokens"]))
                standin.draft(len(words))
                usage = {"prompt_tokens": 9, "completion_tokens": len(words), "total_tokens": 9 + len(words)}
                if not body.get("stream"):
                    self.send(200, json.dumps({"choices": [{"index": 0, "text": "".join(words)}], "usage": usage}))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for w in words:
                    time.sleep(0.001)
                    self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': w}]})}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

        return Handler
