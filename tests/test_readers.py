"""One writer, isolated readers, across processes.

A writer process holds the store's lock: a second writable open anywhere is refused at
once, and works once the writer is gone (closed or killed). Read-only opens beside a
writer that commits in a tight loop each see exactly one generation: every frame and
field they return is what the writer wrote for that id (frames encode their number).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import numbered_frame

from mmreplay import ReplayStore, StoreLockedError
from mmreplay.storage.commit import readers_shared

OBS = (4,)  # a frame is its number as four little-endian bytes

HOLDER = textwrap.dedent("""
    import sys
    from mmreplay import ReplayStore
    store = ReplayStore.open(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.read()  # hold the lock until the parent closes our stdin
    store.close()
""")

WRITER = textwrap.dedent("""
    import os, sys
    import numpy as np
    from mmreplay import ReplayStore
    path, stop = sys.argv[1], sys.argv[2]
    store = ReplayStore.open(path)
    frame = lambda n: np.array([n], "<u4").view(np.uint8)
    n = int(store.counts.frames_written) - 1  # the last frame written
    commits = 0
    print("ready", flush=True)
    while not os.path.exists(stop):
        for _ in range(1 + n % 3):
            store.add(n, float(n), frame(n + 1), False, False)
            n += 1
        store.flush()
        commits += 1
    store.close()
    print(commits, n, flush=True)
""")

READER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from mmreplay import ReplayStore, InvalidStoreError, UnknownIdError
    path, opens = sys.argv[1], int(sys.argv[2])
    import mmreplay.opening as store_module
    calls = 0
    checked = store_module._checked_spec  # one call per open attempt
    def counting(*args, **kwargs):
        global calls
        calls += 1
        return checked(*args, **kwargs)
    store_module._checked_spec = counting
    stats = dict(opens=0, retried=0, most_attempts=0, failures=0, inconsistent=0,
                 raced_get=0, empty=0, checked=0, errors=[])
    def problem(what):
        stats["inconsistent"] += 1
        stats["errors"].append(what)
    for _ in range(opens):
        calls = 0
        stats["opens"] += 1
        try:
            store = ReplayStore.open(path, "r", cache_bytes=0)
        except InvalidStoreError as exc:
            stats["failures"] += 1
            stats["errors"].append(f"{exc} after {calls} attempts")
            continue
        finally:
            stats["retried"] += calls > 1
            stats["most_attempts"] = max(stats["most_attempts"], calls)
        counts = store.counts
        ids = store.valid_ids()  # empty when the writer overtook the whole generation read
        stats["empty"] += ids.size == 0
        try:
            batch = store.get(ids)
        except UnknownIdError:  # the writer gave some up meanwhile: refused, not wrong
            stats["raced_get"] += 1
            store.close()
            continue
        total = counts.transitions
        if counts.frames_written != total + 1:
            problem(f"frames_written {counts.frames_written} with {total} transitions")
        if ids.size and not np.array_equal(ids, np.arange(ids[0], total)):
            problem(f"ids {ids[0]}..{ids[-1]} ({ids.size}) with {total} transitions")
        # A frame is 4 bytes (OBS): said outright, so that an empty batch reshapes too.
        obs = batch.obs.numpy().reshape(ids.size, 4).view("<u4").reshape(-1)
        nxt = batch.next_obs.numpy().reshape(ids.size, 4).view("<u4").reshape(-1)
        for name, got, want in [("obs", obs, ids), ("next_obs", nxt, ids + 1),
                                ("action", batch.action.numpy(), ids),
                                ("reward", batch.reward.numpy(), ids.astype(np.float32))]:
            if not np.array_equal(got, want):
                problem(f"{name} differs from the ids in generation {store.generation}")
        stats["checked"] += int(ids.size)
        store.close()
    print(json.dumps(stats))
""")


def make_store(path, **kw) -> None:
    """A small store whose frame n is `numbered_frame(n, OBS)` (n as four little-endian
    bytes) and whose transition t has action t."""
    kw.setdefault("capacity", 64)
    kw.setdefault("chunk_frames", 4)
    kw.setdefault("block_slots", 16)
    store = ReplayStore.create(path, obs_shape=OBS, seed=0, **kw)
    store.reset(numbered_frame(0, OBS))
    for n in range(40):
        store.add(n, float(n), numbered_frame(n + 1, OBS), False, False)
    store.close()


def spawn(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"child did not start: {line!r} {proc.communicate()[1]}")


@pytest.mark.parametrize("writer_ends", ["close", "sigkill"])
def test_second_writer_is_refused_at_once_across_processes(tmp_path, writer_ends):
    path = tmp_path / "store"
    make_store(path)
    holder = spawn(HOLDER, path)
    try:
        wait_ready(holder)
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(StoreLockedError, match="already open for writing"):
                ReplayStore.open(path)
            assert time.monotonic() - start < 1.0  # refused, not waited for
        with ReplayStore.open(path, "r") as reader:  # readers take no lock
            assert reader.counts.transitions == 40
        if writer_ends == "close":
            holder.communicate("", timeout=30)
            assert holder.returncode == 0
        else:
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=30)
    finally:
        holder.kill()
        holder.communicate()
    with ReplayStore.open(path) as store:  # the kernel dropped the lock with the writer
        assert store.counts.transitions == 40


@pytest.mark.integration
def test_read_only_opens_see_one_generation_beside_a_committing_writer(tmp_path):
    path, stop = tmp_path / "store", tmp_path / "stop"
    make_store(path)
    opens = int(os.environ.get("MMREPLAY_READER_OPENS", "150"))
    writer = spawn(WRITER, path, stop)
    wait_ready(writer)
    readers = [spawn(READER, path, opens) for _ in range(3)]
    try:
        outs = [r.communicate(timeout=300) for r in readers]
    finally:
        stop.touch()
        for r in readers:
            r.kill()
        commits_line, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    for r, (_out, err) in zip(readers, outs, strict=True):
        assert r.returncode == 0, err
    stats = [json.loads(out) for out, _ in outs]
    total = {k: sum(s[k] for s in stats) for k in stats[0] if k != "errors"}
    total["most_attempts"] = max(s["most_attempts"] for s in stats)
    errors = [e for s in stats for e in s["errors"]]
    print(f"\nreaders: {total}; writer commits, last frame: {commits_line.split()}")
    assert total["opens"] == 3 * opens
    assert total["failures"] == 0, errors[:5]
    # The readers lock keeps a loading reader's files; without it ~40% of opens retried.
    assert total["retried"] <= total["opens"] // 20, total
    assert total["inconsistent"] == 0, errors[:5]
    assert total["checked"] > 0
    with ReplayStore.open(path, "r") as store:  # and the writer's last flush is all there
        ids = store.valid_ids()
        assert store.counts.transitions == int(commits_line.split()[1])
        batch = store.get(ids)
        assert np.array_equal(batch.action.numpy(), ids)


@pytest.mark.integration
def test_the_reader_script_takes_an_empty_view_for_what_it_is(tmp_path):
    """A reader that finds no sampleable transition (the writer overtook its generation,
    or none was written yet) checks nothing and says so, rather than failing."""
    path = tmp_path / "store"
    store = ReplayStore.create(path, obs_shape=OBS, capacity=64, chunk_frames=4, seed=0)
    store.reset(numbered_frame(0, OBS))
    store.close()
    out, err = spawn(READER, path, 2).communicate(timeout=120)
    stats = json.loads(out)
    assert (stats["opens"], stats["empty"], stats["checked"]) == (2, 2, 0), (stats, err)
    assert stats["inconsistent"] == stats["failures"] == 0, stats


def step_files(path) -> set[str]:
    return {p.relative_to(path).as_posix() for d in ("steps", "tail") for p in (path / d).iterdir()}


def test_a_loading_reader_keeps_the_files_of_its_generation(tmp_path):
    """While a reader holds `readers`, commits delete nothing; the first commit after does."""
    path = tmp_path / "store"
    make_store(path)
    writer = ReplayStore.open(path)
    before = step_files(path)
    with readers_shared(path):
        for n in range(40, 60):
            writer.add(n, float(n), numbered_frame(n + 1, OBS), False, False)
            writer.flush()
        assert before <= step_files(path)  # nothing the loading reader may read is gone
        assert writer._commits.retired
    writer.add(60, 60.0, numbered_frame(61, OBS), False, False)
    writer.flush()
    assert not writer._commits.retired
    assert step_files(path) == {n for n in writer._commits.committed["files"]
                                if n.startswith(("steps/", "tail/"))}
    writer.close()


def test_files_a_reader_kept_past_close_go_at_the_next_writable_open(tmp_path):
    path = tmp_path / "store"
    make_store(path)
    with readers_shared(path):
        writer = ReplayStore.open(path)
        writer.add(40, 40.0, numbered_frame(41, OBS), False, False)
        writer.close()
        leftover = step_files(path)
    store = ReplayStore.open(path)
    named = {n for n in store._commits.committed["files"] if n.startswith(("steps/", "tail/"))}
    assert step_files(path) == named < leftover
    store.close()


def test_a_reader_without_the_readers_file_still_opens(tmp_path):
    path = tmp_path / "store"
    make_store(path)
    (path / "readers").unlink()
    with ReplayStore.open(path, "r") as store:
        assert store.counts.transitions == 40
    assert not (path / "readers").exists()  # a read-only open writes nothing


def test_a_read_only_sample_checks_the_manifest_once_and_skips_what_the_writer_gave_up(
        tmp_path, monkeypatch):
    """A read-only store's `sample` checks the writer's manifest once a batch (after its
    read), not before the draw too: a draw that took a transition the writer gave up
    since is read, found out and drawn again, so no batch holds one, and every frame is
    the one its transition recorded."""
    path = tmp_path / "store"
    make_store(path)
    writer = ReplayStore.open(path)
    reader = ReplayStore.open(path, "r", cache_bytes=0)
    stats = []
    real_stat = os.stat

    def counting(p, *args, **kwargs):
        if str(p).endswith("manifest.json"):
            stats.append(p)
        return real_stat(p, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counting)
    for _ in range(5):
        reader.sample(8)
    assert len(stats) == 5  # nothing changed: one check a batch
    at_open = set(reader.valid_ids().tolist())
    for round_ in range(6):  # the writer laps the 64-slot ring and commits each time
        for n in range(40 + 8 * round_, 48 + 8 * round_):
            writer.add(n, float(n), numbered_frame(n + 1, OBS), False, False)
        writer.flush()
        kept = set(writer.valid_ids().tolist())
        for _ in range(4):
            batch = reader.sample(16)
            ids = batch.ids.numpy()
            assert set(ids.tolist()) <= at_open & kept, round_
            assert np.array_equal(batch.obs.numpy().reshape(16, -1).view("<u4")[:, 0], ids)
            assert np.array_equal(batch.next_obs.numpy().reshape(16, -1).view("<u4")[:, 0],
                                  ids + 1)
    assert reader.valid_ids().size < len(at_open)  # the reader did follow the give-ups
    reader.close()
    writer.close()
