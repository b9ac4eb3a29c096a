"""`lucifer-shard smoke URL`: check a running vLLM server (proof/smoke_client.py asks, proof/smoke.py judges)."""
from __future__ import annotations

import logging
import time

import click

from ..errors import CheckFailed
from ..proof.smoke import COUNTING_FIRST_POSITION, MAX_CONCURRENCY  # the standard library only: cheap at start
from .console import Console, conventions

MAX_TOKENS = 4096


def _with_threshold(f):
    """Writes proof/smoke.py's threshold into the help, in place of its docstring's THRESHOLD."""
    f.__doc__ = f.__doc__.replace("THRESHOLD", f"{COUNTING_FIRST_POSITION:.2f}", 1)
    return f


@click.command("smoke")
@click.argument("url")
@click.option("--model", default=None,
              help="The served model name to expect, failing when /v1/models lacks it: vLLM's --served-model-name, "
                   "else the path vLLM was given (lucifer-shard serve gives it OUT's absolute path). Default: the "
                   "first model served.")
@click.option("--concurrency", type=click.IntRange(1, MAX_CONCURRENCY), default=4, show_default=True,
              help=f"Streamed requests run together for the second latency figure (at most {MAX_CONCURRENCY}).")
@click.option("--max-tokens", type=click.IntRange(2, MAX_TOKENS), default=32, show_default=True,
              help="Tokens each greedy and latency request decodes (vLLM's ignore_eos: always all of them).")
@click.option("--draft-tokens", type=click.IntRange(8, MAX_TOKENS), default=64, show_default=True,
              help="Tokens decoded for each acceptance prompt (counting, prose) when the server drafts: at k=5 at least "
                   "10 drafts (each step emits at most 6 tokens), enough for a first-position rate.")
@click.option("--expect-draft", is_flag=True,
              help="Fail when the server does not draft (after serve --draft: the draft really runs).")
@click.option("--batch-invariant", is_flag=True,
              help="The server runs with batch invariance (VLLM_BATCH_INVARIANT=1, which smoke cannot see): two "
                   "outputs of the same greedy request that differ fail. Without it they are a warning, since vLLM "
                   "promises identical online outputs only with batch invariance.")
@click.option("--prompts", type=click.Choice(("auto", "text", "tokens")), default="auto", show_default=True,
              help="Send the prompts as text or as token ids (vLLM's completions take a list of ids: a server started "
                   "with --skip-tokenizer-init has no tokenizer and answers a text prompt HTTP 400); auto sends text "
                   "and turns to token ids when the server refuses it with 400. The output says which it used.")
@click.option("--timeout", type=click.FloatRange(1, 3600), default=300, show_default=True,
              help="Seconds for the whole run, however slowly the server answers; past it, exit 2 naming the step.")
@conventions(interrupted="interrupted: smoke stopped (it changes nothing on the server)")
@_with_threshold
def smoke(url: str, model: str | None, concurrency: int, max_tokens: int, draft_tokens: int, expect_draft: bool,
          batch_invariant: bool, prompts: str, timeout: float) -> None:
    """Check a running vLLM OpenAI-compatible server at URL (e.g. http://127.0.0.1:8000), as
    `lucifer-shard serve` started it or any vLLM serving DeepSeek-V4. Changes nothing on the server.

    \b
    1. GET /version and /v1/models: vLLM's version and the served model (--model: expected).
    2. One greedy request (temperature 0, --max-tokens) sent twice: outputs that differ are a
       warning, a failure with --batch-invariant (vLLM promises identity only under it).
    3. Streamed requests at concurrency 1 and --concurrency: time to first token and decode tok/s
       (tokens after the first over the time after the first), reported, never judged.
    4. When /metrics has vLLM's spec-decode counters (the server drafts: serve --draft), one
       counting and one prose prompt, each read from the counters' deltas around it: acceptance
       per draft position (vllm:spec_decode_num_accepted_tokens_per_pos_total / drafts), accepted
       share and tokens per step. First-position acceptance below THRESHOLD on the counting prompt
       fails, a heuristic (its threshold printed with the verdict): a healthy DSpark accepts ~1.00
       there, and a drafter that loaded incompletely keeps the output correct while its acceptance
       falls (docs/serving.md cites the figures); a partly working drafter may still clear it.
    Without a tokenizer on the server (--prompts), the same steps run on token ids: a fixed
    sequence for the greedy and latency requests, a cycle of 16 ids repeated six times in the
    counting prompt's place (a target continues it by copying), random ids in the prose's.
    Every prompt starts with a random nonce, so no earlier run's prefix cache answers it. Run it on
    an idle server: other requests add to the counters. Exit 0 when every check passes, 1 when one
    fails (kind check_failed), 2 when URL answers nothing, is not vLLM, answers what smoke cannot
    use (an answer past 8 MiB or a stream line past 1 MiB, a count that is none, counters that went
    backwards: a restart), or --timeout passes, cutting any request still open (kind server). e.g.
      lucifer-shard smoke http://127.0.0.1:8000 --model /data/out --expect-draft
    """
    started = time.monotonic()  # --timeout counts from here: the HTTP client's import is part of the run
    from ..proof.smoke_client import SmokeOptions, run

    con = Console.of()
    log = logging.getLogger("lucifer_shard.smoke")
    report = run(url, SmokeOptions(model=model, max_tokens=max_tokens, concurrency=concurrency, draft_tokens=draft_tokens,
                                   expect_draft=expect_draft, timeout=timeout, prompts=prompts,
                                   batch_invariant=batch_invariant, started=started), log=log.info)
    con.emit(report.to_dict(), report.lines())
    if report.failed:
        raise CheckFailed(f"smoke: {len(report.failed)} check(s) failed; first: {report.failed[0]}")
