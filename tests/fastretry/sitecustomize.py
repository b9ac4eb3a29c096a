"""Test harness for the tests of a failing link (tests/test_hub.py, tests/test_fetch.py): a subprocess whose
PYTHONPATH names this folder runs huggingface_hub with its retry waits cut to 10 ms each (1 s between
download retries, a 1-8 s backoff between request retries), so a link that stays down shows all of
huggingface_hub's retries within a second or two instead of half a minute. Only the waits are replaced:
the retries, their number and the errors they end in are huggingface_hub's own."""
import time
import types

_sleep = time.sleep
_short = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
_short.sleep = lambda seconds: _sleep(min(seconds, 0.01))

from huggingface_hub import file_download  # noqa: E402 - after the shim is made
from huggingface_hub.utils import _http  # noqa: E402

file_download.time = _short
_http.time = _short
