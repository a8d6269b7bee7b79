"""The viewer's HTTP server (standard library `http.server`, one thread per request).

Routes, all GET (HEAD too); nothing else is served::

    /                                   the page (static/index.html)
    /static/NAME                        app.js, style.css, ... (names fixed at start-up)
    /api/status                         generation and counts (polled by the page)
    /api/overview                       config, counts, disk, RAM, sampler, directory
    /api/health[?run=1]                 the newest verify run (run=1 starts one, bounded)
    /api/episodes?sort=&order=&status=&env=&kept=&offset=&limit=   one page of episodes
    /api/series                         return and length over episode number
    /api/episode/E                      steps of episode E
    /api/episode/first                  steps of the first kept episode ({"episode": null}: none)
    /api/episode/E/frame/T.png          kept frame T of episode E
    /api/episode/E.gif?fps=&scale=      episode E as an animated GIF
    /api/episode/E.mp4?fps=&scale=&lossless=   episode E as an H.264 MP4 (PyAV)
    /api/transition/ID                  fields of transition ID
    /api/transition/ID/obs.png|next.png its stacked state / n-step next state
    /api/sampling?batch=&seed=&beta=    the sampler's distribution and a fresh batch

No part of a URL becomes a file path: static files are read once, from the package, into a
dict keyed by name, and every other route is a pattern over integers. Errors are JSON
``{"error": ...}`` with 400 (bad request), 404 (unknown route, id or episode), 403 (a Host
header that does not name this machine, on a loopback address) or 500 (the store could not
be read), which the page shows in its error panel.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from mmreplay.errors import InvalidInputError, MmreplayError, UnknownIdError
from mmreplay.tools.view.data import StoreData
from mmreplay.tools.view.health import DEFAULT_LIMIT_S
from mmreplay.tools.view.tables import int_param

TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".txt": "text/plain; charset=utf-8",
         ".svg": "image/svg+xml"}
CSP = "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; script-src 'self'"
Reply = tuple[int, str, bytes]
LOOPBACK = ("127.0.0.1", "::1", "localhost")
STATIC_CACHE = "public, max-age=86400, immutable"  # /static/ files: named by content hash


def load_static() -> dict[str, tuple[str, bytes]]:
    """Every file of the package's ``static/`` folder, by name, with its content type.

    The page names its script and style sheet with a hash of their content
    (``/static/app.js?v=HASH``), so the browser may keep them (`STATIC_CACHE`): a view
    opened again loads only the page and its JSON, and a new version is a new name."""
    folder = resources.files("mmreplay.tools.view") / "static"
    out = {}
    for item in folder.iterdir():
        suffix = Path(item.name).suffix
        if item.is_file() and suffix in TYPES:
            out[item.name] = (TYPES[suffix], item.read_bytes())
    kind, page = out["index.html"]
    for name, (_, body) in out.items():
        tag = hashlib.sha256(body).hexdigest()[:12]
        page = page.replace(f'"/static/{name}"'.encode(), f'"/static/{name}?v={tag}"'.encode())
    out["index.html"] = (kind, page)
    return out


class ViewerServer(ThreadingHTTPServer):
    """Serves one store; `data` is shared by the request threads (it locks itself)."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, data: StoreData, host: str = "127.0.0.1", port: int = 0, *,
                 log: bool = False) -> None:
        self.data, self.static, self.log = data, load_static(), log
        super().__init__((host, port), Handler)

    def host_allowed(self, host: str) -> bool:
        """On a loopback address, only requests naming this machine (``Host: 127.0.0.1:N``,
        ``localhost:N``): a web page whose name a DNS trick pointed here cannot read the
        store. A server bound elsewhere (``--host``) answers any name."""
        bound, port = str(self.server_address[0]), self.server_address[1]
        if bound not in LOOPBACK:
            return True
        return host.lower() in {f"{name}:{port}" for name in ("127.0.0.1", "localhost",
                                                               "[::1]", bound)}

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else host
        return f"http://{name}:{port}/"

    def server_close(self) -> None:
        super().server_close()
        self.data.close()


def make_server(path: str | Path, *, host: str = "127.0.0.1", port: int = 0,
                log: bool = False, verify_limit_s: float = DEFAULT_LIMIT_S) -> ViewerServer:
    """A server for the store at `path` (opened now: a bad store raises here).

    A background thread then builds the episode table and draws a first frame
    (`StoreData.warm`), so the first page opened finds them ready.
    """
    data = StoreData(path, verify_limit_s=verify_limit_s)
    data.store()
    try:
        server = ViewerServer(data, host, port, log=log)
    except BaseException:
        data.close()
        raise
    threading.Thread(target=data.warm, name="mmreplay-view-warm", daemon=True).start()
    return server


# -- routes ----------------------------------------------------------------------------------
Route = tuple[re.Pattern[str], Callable[[StoreData, re.Match[str], dict[str, str]], Reply]]


def _json(value: Any) -> Reply:
    return 200, "application/json", json.dumps(value, allow_nan=False).encode()


def _png(data: bytes) -> Reply:
    return 200, "image/png", data


def _sampling(d: StoreData, m: re.Match[str], q: dict[str, str]) -> Reply:
    seed = q.get("seed") or None
    beta = q.get("beta", "0.4")
    try:
        beta_value = float(beta)
    except ValueError:
        raise InvalidInputError(f"beta must be a number, got {beta[:40]!r}") from None
    return _json(d.sampling(int_param("batch", q.get("batch", "16"), 1, 64),
                            None if seed is None else int_param("seed", seed, 0, 2 ** 63),
                            beta_value))


def _gif(d: StoreData, m: re.Match[str], q: dict[str, str]) -> Reply:
    fps = int_param("fps", q.get("fps", "15"), 1, 60)
    scale = int_param("scale", q.get("scale", "2"), 1, 8)
    return 200, "image/gif", d.episode_gif(int(m[1]), fps=fps, scale=scale)


def _mp4(d: StoreData, m: re.Match[str], q: dict[str, str]) -> Reply:
    fps = int_param("fps", q.get("fps", "15"), 1, 60)
    scale = int_param("scale", q.get("scale", "2"), 1, 8)
    lossless = int_param("lossless", q.get("lossless", "0"), 0, 1) == 1
    return 200, "video/mp4", d.episode_mp4(int(m[1]), fps=fps, scale=scale, lossless=lossless)


def _health(d: StoreData, m: re.Match[str], q: dict[str, str]) -> Reply:
    run = int_param("run", q.get("run", "0"), 0, 1) == 1
    return _json(d.health.run() if run else d.health.state())


ROUTES: list[Route] = [
    (re.compile(r"/api/health"), _health),
    (re.compile(r"/api/status"), lambda d, m, q: _json(d.status())),
    (re.compile(r"/api/overview"), lambda d, m, q: _json(d.overview())),
    (re.compile(r"/api/episodes"), lambda d, m, q: _json(d.episodes(q))),
    (re.compile(r"/api/series"), lambda d, m, q: _json(d.series())),
    (re.compile(r"/api/episode/(\d{1,18})"), lambda d, m, q: _json(d.episode(int(m[1])))),
    (re.compile(r"/api/episode/first"), lambda d, m, q: _json(d.first_episode())),
    (re.compile(r"/api/episode/(\d{1,18})/frame/(\d{1,18})\.png"),
     lambda d, m, q: _png(d.frame_png(int(m[1]), int(m[2])))),
    (re.compile(r"/api/episode/(\d{1,18})\.gif"), _gif),
    (re.compile(r"/api/episode/(\d{1,18})\.mp4"), _mp4),
    (re.compile(r"/api/transition/(\d{1,18})"),
     lambda d, m, q: _json(d.transition(int(m[1])))),
    (re.compile(r"/api/transition/(\d{1,18})/(obs|next)\.png"),
     lambda d, m, q: _png(d.stack_png(int(m[1]), m[2]))),
    (re.compile(r"/api/sampling"), _sampling),
]


class Handler(BaseHTTPRequestHandler):
    server: ViewerServer
    timeout = 30  # a client that stops sending holds its thread this long at most
    server_version = "mmreplay-view"
    protocol_version = "HTTP/1.1"  # keep-alive: the page's requests reuse a connection
    # Headers and body are two writes; with Nagle on a kept-alive connection the body would
    # wait for the client's delayed ACK of the headers (40 ms on Linux).
    disable_nagle_algorithm = True

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._send(*self._reply())

    def do_HEAD(self) -> None:  # noqa: N802
        self._send(*self._reply())

    def _reply(self) -> Reply:
        parts = urlsplit(self.path)
        if not self.server.host_allowed(self.headers.get("Host", "")):
            return _error(HTTPStatus.FORBIDDEN, "this server answers only to the address it "
                                                "printed (Host header refused)")
        try:
            if not parts.path.startswith("/api/"):
                return self._static(parts.path)
            query = _query(parts.query)
            for pattern, handle in ROUTES:
                match = pattern.fullmatch(parts.path)
                if match:
                    return handle(self.server.data, match, query)
            return _error(HTTPStatus.NOT_FOUND, f"no such endpoint: {parts.path[:80]}")
        except (UnknownIdError, KeyError) as exc:
            return _error(HTTPStatus.NOT_FOUND, str(exc).strip("'\""))
        except InvalidInputError as exc:
            return _error(HTTPStatus.BAD_REQUEST, str(exc))
        except (MmreplayError, OSError, ValueError) as exc:
            return _error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

    def _static(self, path: str) -> Reply:
        name = "index.html" if path == "/" else path.removeprefix("/static/")
        found = self.server.static.get(name) if name == "index.html" or \
            path.startswith("/static/") else None
        if found is None:
            return _error(HTTPStatus.NOT_FOUND, f"not found: {path[:80]}")
        return 200, found[0], found[1]

    def _send(self, status: int, kind: str, body: bytes) -> None:
        static = status == 200 and self.path.startswith("/static/")
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", STATIC_CACHE if static else "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", CSP)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the page moved on before the answer arrived

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (base signature)
        if self.server.log:
            sys.stderr.write(f"{self.address_string()} {format % args}\n")


def _query(text: str) -> dict[str, str]:
    try:
        return dict(parse_qsl(text, max_num_fields=32))
    except ValueError:
        raise InvalidInputError("at most 32 query parameters") from None


def _error(status: int, message: str) -> Reply:
    return status, "application/json", json.dumps({"error": message}).encode()
