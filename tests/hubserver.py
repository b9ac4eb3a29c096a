"""A stand-in for the Hugging Face Hub on 127.0.0.1, serving local checkpoint folders as model repos.

Why it exists: these machines reach no Hub, yet the Hub path must run huggingface_hub's own client
code (its URL building, HEAD metadata, resumable ranged downloads, repo info and tree listings), not
a fake of lucifer-shard's. Point `HF_ENDPOINT` at `HubServer.url` and huggingface_hub talks to this
server as it would to the Hub. It stands in for the Hub only, never for lucifer-shard code.

It answers the routes huggingface_hub 2.x uses to download (read from its `file_download.py`,
`_snapshot_download.py` and `hf_api.py`):

    GET  /api/models/{repo}/revision/{rev}[?blobs=true]   repo info: commit sha, siblings (+ sizes, LFS sha256)
    GET  /api/models/{repo}/tree/{rev}[/{path}]             the tree listing snapshot_download reads
    HEAD /{repo}/resolve/{rev}/{file}                       X-Repo-Commit, ETag / X-Linked-Etag, sizes
    GET  /{repo}/resolve/{rev}/{file}                       the bytes, with Range (206) as the Hub does

`*.safetensors` files are served as LFS files (their SHA-256 as X-Linked-Etag and in `lfs.sha256`),
the others as git blobs (ETag: the git blob id), as on the Hub. Every request is recorded
(`requests`), so tests can prove the order of what a command asked for and the bytes it fetched.
`tamper` serves other bytes for a file while its published SHA-256 (or git blob id) stays the original's,
on every GET of it, or on those `lie_on` counts (from 1: a Hub that changes under a conversion, the same
commit answering one request with other bytes than another); `stall_after`
blocks a download once that many body bytes were sent (a test then kills the client mid-download);
`fail_after` (with `fail`) makes the link fail once that many body bytes were sent: "reset" closes the
connection mid-body (the client's RemoteProtocolError), "refuse" stops the server (every later
connection refused), "status:N" answers every later file request with HTTP N (503, or 402 with the
Hub's EgressLimitReached code); `ignore_range` answers a ranged GET with the whole file (200).
Downloads are served at once, each on its own connection (a thread each): `rate` paces all of them
together (the link), `conn_rate` each one on its own (a CDN's cap per connection); `most_at_once`
counts how many sent at the same time. `xet` describes the LFS files as the Hub describes Xet-stored
ones (the headers only: no Xet storage service stands in here).

Run alone: python tests/hubserver.py owner/name=DIR [owner/other=DIR2 ...] [--rate=BYTES_PER_S]
[--conn-rate=BYTES_PER_S]
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

CHUNK = 1 << 20
LFS_SUFFIXES = (".safetensors",)


@dataclass
class Served:
    """One file of a repo as the Hub describes it."""

    path: Path
    size: int
    sha256: str
    blob_id: str  # git blob sha1 (what the Hub reports as `oid`/`blobId`)
    lfs: bool


@dataclass
class Repo:
    root: Path
    commit: str
    files: dict[str, Served] = field(default_factory=dict)


@dataclass
class Request:
    """One request, recorded as it arrives (so the log is in arrival order, a killed download included)."""

    method: str
    path: str  # the file or API route, after the repo id
    range: str | None
    sent: int = 0  # body bytes sent (so far, for a download still running)
    due: float = 0.0  # when its connection's cap (`conn_rate`) lets its next bytes go
    first: float | None = None  # time.perf_counter() as its first body byte went out, and its last (`last`)
    last: float | None = None


def _describe(root: Path) -> dict[str, Served]:
    files = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if not p.is_file() or p.is_symlink() or rel.startswith(".") or "/." in rel:
            continue
        sha, blob = hashlib.sha256(), hashlib.sha1(f"blob {p.stat().st_size}\0".encode())
        with open(p, "rb") as f:
            while chunk := f.read(CHUNK):
                sha.update(chunk)
                blob.update(chunk)
        files[rel] = Served(p, p.stat().st_size, sha.hexdigest(), blob.hexdigest(), rel.endswith(LFS_SUFFIXES))
    return files


class HubServer:
    """`with HubServer({"owner/name": folder}) as hub:` serves those folders at `hub.url` until the block ends."""

    def __init__(self, repos: dict[str, Path | str], port: int = 0):
        self.repos: dict[str, Repo] = {}
        for repo_id, root in repos.items():
            self.add(repo_id, root)
        self.requests: list[Request] = []
        self.tamper: dict[tuple[str, str], bytes] = {}  # (repo, file) -> bytes served instead
        self.lie_on: dict[tuple[str, str], range | set[int]] = {}  # (repo, file) -> its GETs `tamper` answers
        self._gets: dict[tuple[str, str], int] = {}  # (repo, file) -> GETs served so far
        self.stall_after: int | None = None  # body bytes of resolve GETs after which downloads block
        self.stall_min_body = 0  # ... those that sent this many bytes of their own (1 << 18: not a header read)
        self.rate: float | None = None  # bytes per second all downloads share (None: as fast as loopback goes)
        self.conn_rate: float | None = None  # bytes per second of each download on its own, as a CDN caps a connection
        self.xet = False  # describe LFS files as Xet-stored (X-Xet-Hash and its refresh route), as the Hub does
        self.at_once = 0  # downloads sending their bodies now
        self.most_at_once = 0  # the most downloads that sent their bodies at the same time
        self.fail_after: int | None = None  # body bytes of resolve GETs after which the link fails (`fail`)
        self.fail = "reset"  # how: "reset", "refuse" or "status:N"
        self.failed = threading.Event()  # set once the link failed
        self.ignore_range = False  # a ranged GET gets the whole file with 200, as a server without ranges
        self.stalled = threading.Event()  # set once a download blocked
        self._release = threading.Event()
        self._sent = 0
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    def add(self, repo_id: str, root: Path | str) -> Repo:
        """Serve `root` as `repo_id` (again, after its files changed: a new commit)."""
        files = _describe(Path(root))
        commit = hashlib.sha1(repo_id.encode() + b"".join(f"{n}\0{f.sha256}\0".encode()
                                                           for n, f in files.items())).hexdigest()
        self.repos[repo_id] = Repo(Path(root), commit, files)
        return self.repos[repo_id]

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hubserver", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def stop(self) -> None:
        """Stop serving: the listening socket closed, so every later connection is refused."""
        self._httpd.shutdown()
        self._httpd.server_close()

    def failing(self) -> str | None:
        """How the link fails now ("status:N" for a new request), or None."""
        return self.fail if self.failed.is_set() else None

    def release(self) -> None:
        """Let stalled downloads go on (and no further stalls)."""
        self.stall_after = None
        self._release.set()

    def files_requested(self, method: str = "GET") -> list[str]:
        """The files whose bytes were asked for (resolve GETs), in order."""
        return [r.path for r in self.requests if r.method == method and not r.path.startswith("api/")]

    def bytes_sent(self, suffix: str = "") -> int:
        return sum(r.sent for r in self.requests if r.method == "GET" and r.path.endswith(suffix))

    def rate_since(self, first: int, suffix: str = "", beyond: int = 0) -> float | None:
        """Bytes per second of the downloads of files ending in `suffix` among requests[first:] that sent more
        than `beyond` bytes (not a shard's header read), from the first body byte sent to the last."""
        got = [r for r in self.requests[first:] if r.method == "GET" and r.path.endswith(suffix) and r.first
               and r.sent > beyond]
        if not got:
            return None
        took = max(r.last or r.first for r in got) - min(r.first for r in got)
        return sum(r.sent for r in got) / took if took > 0 else None

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def _count(self, n: int, request: Request) -> None:
        """Account `n` body bytes about to be sent for `request`; block while a stall is on, or until `rate`
        allows them."""
        with self._lock:
            self._sent += n
            stall = (self.stall_after is not None and self._sent > self.stall_after
                     and request.sent + n > self.stall_min_body)
            now = time.perf_counter()
            wait = 0.0
            if self.rate:
                self._due = max(getattr(self, "_due", 0.0), now) + n / self.rate
                wait = self._due - now
            if self.conn_rate:
                request.due = max(request.due, now) + n / self.conn_rate
                wait = max(wait, request.due - now)
        if wait > 0:
            time.sleep(wait)
        if stall:
            self.stalled.set()
            self._release.wait()
        if self.fail_after is not None and self._sent > self.fail_after:
            self.failed.set()
            if self.fail == "refuse":
                threading.Thread(target=self.stop, daemon=True).start()
            raise ConnectionResetError("the stand-in Hub dropped the link")


RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")
API = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<what>revision|tree)/(?P<rev>[^/]+)(?:/(?P<path>.*))?)?")
RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet: the tests read `hub.requests`
            pass

        def do_HEAD(self) -> None:
            self._route(body=False)

        def do_GET(self) -> None:
            self._route(body=True)

        def _route(self, body: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            m = API.fullmatch(path)
            if m:
                return self._api(m, parse_qs(url.query), body)
            m = RESOLVE.fullmatch(path)
            if m:
                return self._resolve(m, body)
            self._error(404, "RepoNotFound", f"no route {path}", path, body)

        def _repo(self, m: re.Match, where: str, body: bool) -> Repo | None:
            repo = hub.repos.get(m["repo"])
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}", where, body)
            elif m["rev"] not in (None, "main", repo.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {m['rev']}", where, body)
                return None
            return repo

        def _api(self, m: re.Match, query: dict, body: bool) -> None:
            where = f"api/{m['what'] or 'revision'}/{m['path'] or ''}"
            repo = self._repo(m, where, body)
            if repo is None:
                return
            if m["what"] != "tree":
                blobs = query.get("blobs") == ["true"]
                doc = {"id": m["repo"], "modelId": m["repo"], "sha": repo.commit, "private": False,
                       "siblings": [{"rfilename": n, **(_blob(f) if blobs else {})} for n, f in repo.files.items()],
                       **({"cardData": _card_data(repo.files["README.md"].path)} if "README.md" in repo.files else {})}
            else:
                prefix = (m["path"] or "").strip("/")
                doc = [{"type": "file", "path": n, "size": f.size, "oid": f.blob_id,
                        **({"lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 134}} if f.lfs else {})}
                       for n, f in repo.files.items() if not prefix or n.startswith(prefix + "/")]
            self._send(200, json.dumps(doc).encode(), {"Content-Type": "application/json"}, where, body)

        def _resolve(self, m: re.Match, body: bool) -> None:
            repo = self._repo(m, m["file"], body)
            if repo is None:
                return
            how = hub.failing()
            if how is not None and how.startswith("status:"):
                status = int(how.split(":")[1])
                code = "EgressLimitReached" if status == 402 else "ServiceUnavailable"
                return self._error(status, code, f"the stand-in Hub answers {status}", m["file"], body)
            served = repo.files.get(m["file"])
            if served is None:
                return self._error(404, "EntryNotFound", f"{m['file']} does not exist on {m['rev']}", m["file"], body)
            data_len = served.size
            headers = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes",
                       "ETag": f'"{served.sha256 if served.lfs else served.blob_id}"',
                       "Content-Type": "application/octet-stream"}
            if served.lfs:
                headers.update({"X-Linked-Etag": f'"{served.sha256}"', "X-Linked-Size": str(served.size)})
            if served.lfs and hub.xet:  # the headers huggingface_hub's parse_xet_file_data_from_response reads
                headers.update({"X-Xet-Hash": served.sha256,
                                "X-Xet-Refresh-Route": f"/api/models/{m['repo']}/xet-read-token/{repo.commit}"})
            lo, hi = 0, data_len
            status = 200
            wanted = self.headers.get("Range")
            if wanted and not hub.ignore_range:
                r = RANGE.fullmatch(wanted.strip())
                if r is None or (not r[1] and not r[2]):
                    return self._error(416, "RangeNotSatisfiable", f"bad range {wanted}", m["file"], body)
                if r[1]:
                    lo = int(r[1])
                    hi = min(data_len, int(r[2]) + 1) if r[2] else data_len
                else:
                    lo = max(0, data_len - int(r[2]))
                if lo >= data_len and data_len:
                    headers["Content-Range"] = f"bytes */{data_len}"
                    return self._send(416, b"", headers, m["file"], body)
                status = 206
                headers["Content-Range"] = f"bytes {lo}-{hi - 1}/{data_len}"
            headers["Content-Length"] = str(hi - lo)
            request = Request(self.command, m["file"], wanted)
            hub._record(request)
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                key = (m["repo"], m["file"])
                with hub._lock:
                    n = hub._gets[key] = hub._gets.get(key, 0) + 1
                lie = key in hub.tamper and (key not in hub.lie_on or n in hub.lie_on[key])
                with hub._lock:
                    hub.at_once += 1
                    hub.most_at_once = max(hub.most_at_once, hub.at_once)
                try:
                    self._stream(hub.tamper[key] if lie else None, served.path, lo, hi, request)
                finally:
                    with hub._lock:
                        hub.at_once -= 1

        def _stream(self, tampered: bytes | None, path: Path, lo: int, hi: int, request: Request) -> None:
            with open(path, "rb") as f:
                f.seek(lo)
                while lo + request.sent < hi:
                    n = min(CHUNK, hi - lo - request.sent)
                    chunk = tampered[lo + request.sent:lo + request.sent + n] if tampered is not None else f.read(n)
                    try:
                        hub._count(len(chunk), request)
                        request.first = request.first or time.perf_counter()
                        self.wfile.write(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        self.close_connection = True
                        return  # the client went away (killed mid-download), or the link was dropped (`fail`)
                    request.sent += len(chunk)
                    request.last = time.perf_counter()

        def _error(self, status: int, code: str, message: str, where: str, body: bool) -> None:
            self._send(status, json.dumps({"error": message}).encode(),
                       {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message},
                       where, body)

        def _send(self, status: int, data: bytes, headers: dict[str, str], where: str, body: bool) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            hub._record(Request(self.command, where, self.headers.get("Range"), len(data) if body else 0))
            if body:
                self.wfile.write(data)

    return Handler


def _card_data(readme: Path) -> dict:
    """The front matter of a repo's README.md, as the Hub returns it in the repo info (`cardData`)."""
    import yaml

    text = readme.read_text(errors="replace")
    if not text.startswith("---\n") or "\n---" not in text[4:]:
        return {}
    meta = yaml.safe_load(text[4:text.index("\n---", 4)])
    return meta if isinstance(meta, dict) else {}


def _blob(f: Served) -> dict:
    return {"size": f.size, "blobId": f.blob_id,
            **({"lfs": {"sha256": f.sha256, "size": f.size, "pointerSize": 134}} if f.lfs else {})}


def main(argv: list[str]) -> None:
    rate = [float(a.split("=", 1)[1]) for a in argv if a.startswith("--rate=")]
    conn_rate = [float(a.split("=", 1)[1]) for a in argv if a.startswith("--conn-rate=")]
    repos = dict(a.split("=", 1) for a in argv if not a.startswith("--"))
    with HubServer(repos) as hub:
        hub.rate = rate[0] if rate else None
        hub.conn_rate = conn_rate[0] if conn_rate else None
        print(f"HF_ENDPOINT={hub.url}", flush=True)
        for repo_id, repo in hub.repos.items():
            print(f"{repo_id} at {repo.commit}: {len(repo.files)} files", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    if len(sys.argv) < 2 or "--help" in sys.argv:
        sys.exit(__doc__)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
