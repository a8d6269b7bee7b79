"""Credentials a server refuses: against SeaweedFS started with an identities file
(`s3_auth`, which checks every request's signature, as AWS does), the right keys work and
a wrong secret or key gives one clear error (what was refused, where the credentials come
from) from the library and exit code 2 from the CLI. Neither the secret nor the wrong one
ever appears in an error, a log line (DEBUG), stdout or stderr.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from mmreplay import ReplayStore
from mmreplay.storage.objects import ObjectAccessDeniedError, open_objects
from mmreplay.tools.cli import main as cli

pytest.importorskip("obstore", reason='needs the cloud extra: pip install "mmreplay[cloud]"')
sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("s3_server")
from s3_server import S3Server  # noqa: E402
from test_object_storage import fill, make  # noqa: E402

pytest_plugins = ["s3_server"]  # the fixtures s3_auth, s3_auth_session

ROOT = Path(__file__).resolve().parents[1]
CLEAR = "access denied by the server"


def mmreplay_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it, with this process's AWS variables."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mmreplay", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_auth_server_refuses_unsigned_requests(s3_auth: S3Server, tmp_path: Path) -> None:
    """The fixture really checks: an anonymous read is refused, a signed one is not."""
    url = s3_auth.url(f"anon-{uuid.uuid4().hex[:8]}")
    open_objects(url).put("probe", b"ok")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{s3_auth.endpoint}/{url[5:]}/probe", timeout=10)
    assert refused.value.code in (401, 403)
    assert open_objects(url).get("probe") == b"ok"


def test_right_keys_work_and_wrong_ones_are_refused_clearly(
        s3_auth: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG)
    url = s3_auth.url(f"auth-{uuid.uuid4().hex[:8]}")
    with make(tmp_path / "a", mirror=url) as store:  # the AWS variables: the right keys
        fill(store, 300)
        store.flush(wait_mirror=True)
    with ReplayStore.open(url, "r", cache_dir=tmp_path) as remote:
        assert remote.sample(8).obs.shape[0] == 8
    assert cli(["info", url]) == 0
    right = s3_auth.options()
    wrong_secret = f"wrong-secret-{uuid.uuid4().hex}"
    messages: list[str] = []

    def refused(call: Callable[[], object]) -> None:
        with pytest.raises(ObjectAccessDeniedError) as info:
            call()
        text = str(info.value)
        assert CLEAR in text and "check the credentials" in text and url in text, text
        messages.extend([text, repr(info.value)])

    with ReplayStore.open(tmp_path / "a", "r+") as store:  # a wrong secret, explicitly
        refused(lambda: store.push(url, storage_options={**right,
                                                          "secret_access_key": wrong_secret}))
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong_secret)  # and in the environment
        refused(lambda: store.push(url))
    refused(lambda: ReplayStore.open(url, "r", cache_dir=tmp_path))
    refused(lambda: ReplayStore.open(url, "r+", local=tmp_path / "b"))
    refused(lambda: make(tmp_path / "c", mirror=url))
    assert not (tmp_path / "b").exists()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_auth.secret_key)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000")  # a key it does not know
    refused(lambda: ReplayStore.open(url, "r", cache_dir=tmp_path))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong_secret)
    assert cli(["info", url]) == 2
    assert cli(["push", str(tmp_path / "a"), url]) == 2
    shell = mmreplay_cli("info", url)
    assert shell.returncode == 2 and CLEAR in shell.stderr, shell.stderr
    out, err = capfd.readouterr()
    assert err.count(CLEAR) == 2  # the two in-process CLI calls
    seen = "\n".join([*messages, caplog.text, out, err, shell.stdout, shell.stderr])
    assert len(messages) == 12
    for secret in (s3_auth.secret_key, wrong_secret):
        assert secret not in seen
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_auth.secret_key)  # the bucket is intact
    with ReplayStore.open(url, "r+", local=tmp_path / "d") as again:
        fill(again, 50, seed=3)
