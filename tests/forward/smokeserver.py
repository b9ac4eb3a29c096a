"""What the smoke-test files of the forward suite share: a tokenizer for the `forward` model, one vLLM
OpenAI-compatible server started in the harness environment (vllm_forward.engine_env) and always
killed, and `lucifer-shard smoke` run against it."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from vllm_forward import engine_env

BOOT_TIMEOUT = 420  # s; measured 29-81 s on this 2-core machine with other work running
SMOKE_ARGS = ("--max-tokens", "8", "--concurrency", "2", "--timeout", "300")
# vLLM's arguments for the `forward` model on this machine (as vllm_forward.py gives vllm.LLM)
VLLM_ARGS = ("--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "4096", "--max-num-seqs", "4", "--seed", "0")


def write_byte_tokenizer(model: Path) -> None:
    """A byte-level tokenizer of the model's vocabulary size (the 256 byte symbols, then fillers that decode
    to their own name), as tokenizer.json + tokenizer_config.json: every text encodes, every id decodes.
    synth writes none, and smoke's prompts are text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    size = json.loads((model / "config.json").read_text())["vocab_size"]
    vocab = {"<s>": 0, "</s>": 1}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    while len(vocab) < size:
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 1048576}))


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "lucifer_shard.cli", *args, "--quiet"], check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def serving(command: list[str], work: Path, **env: str) -> Iterator[tuple[str, float]]:
    """Run `command` (a server, given `--port` here) in a process group of its own, in the harness
    environment plus `env`; (its URL, seconds until /v1/models answered). The group is killed on exit."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    full = {**engine_env(1), **env}
    full.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server as vLLM runs it: its engine core in a process of its own
    url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    with open(work / "server.log", "w") as log:
        proc = subprocess.Popen([*command, "--port", str(port)], env=full, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=work)
        try:
            while not _answers(url):
                if proc.poll() is not None or time.monotonic() - t0 > BOOT_TIMEOUT:
                    tail = (work / "server.log").read_text(errors="replace").splitlines()[-30:]
                    raise RuntimeError(f"the server did not come up (exit {proc.poll()}, {time.monotonic() - t0:.0f} "
                                       f"s); {work / 'server.log'}:\n" + "\n".join(tail))
                time.sleep(1)
            yield url, time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def smoke(url: str, *args: str) -> tuple[subprocess.CompletedProcess, dict, float]:
    """`lucifer-shard smoke URL SMOKE_ARGS ARGS --json`: the process, its envelope, its seconds."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "lucifer_shard.cli", "smoke", url, *SMOKE_ARGS, *args, "--json"],
                       capture_output=True, text=True, timeout=360)
    return r, json.loads(r.stdout), time.monotonic() - t0
