"""The object-storage verbs of the ``mmreplay`` command: thin wrappers over `push` and `pull`.

    mmreplay push STORE URL [--take-over]     upload the committed generation (incremental)
    mmreplay pull URL DIR                     download the newest complete generation, verify

URLs are ``s3://bucket/prefix`` (credentials and endpoint from the AWS environment
variables: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION) or
``file:///dir``. The read-only verbs (info, episodes, show, plot, verify, sample) take a
URL in place of PATH.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mmreplay.errors import InvalidStoreError
from mmreplay.storage.objects import open_objects
from mmreplay.storage.pull import pull
from mmreplay.store import ReplayStore
from mmreplay.tools.verify import VerifyReport, verify_store


def add_remote_commands(sub: Any) -> None:
    text = "upload a store's committed generation to s3://bucket/prefix (only what changed)"
    cmd = sub.add_parser("push", help=text, description=text)
    cmd.add_argument("store", metavar="STORE", help="store directory")
    cmd.add_argument("url", metavar="URL", help="s3://bucket/prefix or file:///dir")
    cmd.add_argument("--take-over", action="store_true",
                     help="push even though another writer holds the prefix's lease")
    cmd.set_defaults(run=cmd_push)
    text = "download a bucket store's newest complete generation into DIR and verify it"
    cmd = sub.add_parser("pull", help=text, description=text)
    cmd.add_argument("url", metavar="URL", help="s3://bucket/prefix or file:///dir")
    cmd.add_argument("directory", metavar="DIR", help="new store directory (must not exist)")
    cmd.set_defaults(run=cmd_pull)


def cmd_push(args: argparse.Namespace) -> int:
    with ReplayStore.open(Path(args.store), mode="r") as store:
        report = store.push(args.url, take_over=args.take_over)
    print(f"pushed generation {report.generation} to {args.url}: {report.uploaded_objects} "
          f"objects ({report.uploaded_bytes} bytes) uploaded, {report.skipped_objects} "
          f"unchanged, {report.deleted_objects} deleted, {report.seconds:.2f} s")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    dest = Path(args.directory)
    if dest.exists():
        raise InvalidStoreError(f"{dest} already exists; pull into a new directory")
    report = pull_verified(args.url, dest)
    print(f"pulled generation {report.generation} from {args.url} into {dest}: "
          f"{report.chunks_checked} frame chunks and {report.files_checked} files verified; "
          f"{report.sampleable} sampleable transitions")
    return 0


def pull_verified(url: str, dest: Path) -> VerifyReport:
    """Pull into a sibling temp directory, verify, then rename it to `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        pull(open_objects(url), partial)
        report = verify_store(partial)
        if not report.ok:
            raise InvalidStoreError(f"{url}: the pulled store fails verification: "
                                    f"{report.problems[0]}")
        os.rename(partial, dest)
        return report
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def verify_url(url: str) -> VerifyReport:
    """`verify_store` on a bucket store (pulled whole into a temp directory)."""
    with tempfile.TemporaryDirectory(prefix="mmreplay-verify-") as tmp:
        pull(open_objects(url), Path(tmp) / "store")
        return verify_store(Path(tmp) / "store")
