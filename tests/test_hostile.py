"""Opening a hostile directory: refused with a one-line `InvalidStoreError`, nothing unpickled,
nothing outside the root read or written, no hang, no big allocation.

The corpus (`hostile_stores.cases`, several hundred malformed stores made from two small
valid ones) is opened in both modes; the cases that would make a careless open allocate or
read gigabytes run in a subprocess that measures its peak RSS. Hypothesis then fuzzes the
manifest parser and the zarr metadata check with arbitrary bytes and JSON values.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import numpy.lib.format as npy_format
import pytest
from hostile_stores import (
    Case,
    Env,
    age_atimes,
    build_store,
    canary_npy,
    cases,
    make_case,
    manifest,
    npy_header,
    open_outcome,
    snapshot,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mmreplay import ReplayStore
from mmreplay.errors import InvalidStoreError, MmreplayError
from mmreplay.storage.layout import check_frames_meta
from mmreplay.storage.manifest import (
    check_manifest,
    check_ram,
    manifest_checksum,
    parse_manifest,
    parse_spec,
)
from mmreplay.storage.safe_io import load_npy, parse_json
from mmreplay.tools.cli import main

CASES = cases()
SMALL = [c for c in CASES if not c.huge]
HUGE = [c for c in CASES if c.huge]
# The reliability promise: a hostile store cannot stall an open. A hang guard, not a speed
# target: the slowest open seen is ~0.5 s on a quiet machine and 2.6-4.7 s on a loaded one, so
# the guard sits far above both; `test_corpus_figures` prints the slowest open as a figure.
HANG_GUARD_SECONDS = 30.0
MAX_RSS_GROWTH_MIB = 512
STATS: dict[str, Any] = {"opens": 0, "refused": 0, "slowest": 0.0, "slowest_case": ""}


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for kind in ("uniform", "prio", "zstd_dict"):
        build_store(root / kind, kind)
        out[kind] = root / kind
    return out


@pytest.fixture(scope="module")
def atime_works(tmp_path_factory: pytest.TempPathFactory) -> bool:
    """Whether this filesystem records reads in atime (relatime does for old atimes)."""
    probe = tmp_path_factory.mktemp("atime") / "f"
    probe.write_bytes(b"x")
    age_atimes(probe.parent)
    before = os.stat(probe).st_atime_ns
    probe.read_bytes()
    return os.stat(probe).st_atime_ns != before


def atimes(path: Path) -> dict[str, int]:
    return {str(p): os.lstat(p).st_atime_ns for p in [path, *path.rglob("*")]}


def refuse_all(env: Env, modes: tuple[str, ...], name: str) -> None:
    """Each mode must raise InvalidStoreError, on one line, fast; a hang aborts the run."""
    for mode in modes:
        faulthandler.dump_traceback_later(60, exit=True)
        try:
            kind, message, seconds = open_outcome(env.root, mode)
        finally:
            faulthandler.cancel_dump_traceback_later()
        STATS["opens"] += 1
        STATS["refused"] += kind == "InvalidStoreError"
        if seconds > STATS["slowest"]:
            STATS["slowest"], STATS["slowest_case"] = seconds, f"{name} ({mode})"
        assert kind == "InvalidStoreError", f"{name} mode {mode}: {kind}: {message}"
        assert message and "\n" not in message, repr(message)
        assert seconds < HANG_GUARD_SECONDS, f"{name} mode {mode} took {seconds:.2f} s"


def check_untouched(env: Env, before: dict[str, Any], times: dict[str, int] | None,
                    listing: list[str]) -> None:
    assert not env.canary.exists(), "a pickle was loaded: the canary fired"
    if times is not None:
        assert atimes(env.outside) == times, "something outside the root was read"
    assert snapshot(env.outside) == before, "something outside the root was written"
    assert sorted(os.listdir(env.root.parent)) == listing, "files appeared beside the root"


# -- the corpus ---------------------------------------------------------------------------
def test_corpus_is_large_and_varied() -> None:
    assert len(CASES) >= 300
    kinds = {c.name.split("-")[0] for c in CASES}
    assert {"manifest", "field", "spec", "zarr", "npy", "link", "fifo", "huge", "name",
            "version", "rng", "cursor", "dict"} <= kinds


@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_hostile_store_is_refused(case: Case, bases: dict[str, Path], tmp_path: Path,
                                  atime_works: bool) -> None:
    env = make_case(case, bases, tmp_path)
    before, listing = snapshot(env.outside), sorted(os.listdir(tmp_path))
    age_atimes(env.outside)
    times = atimes(env.outside) if atime_works else None
    refuse_all(env, case.modes, case.name)
    check_untouched(env, before, times, listing)


@pytest.mark.integration
def test_huge_cases_allocate_nothing(bases: dict[str, Path], tmp_path: Path) -> None:
    """Out of process: every huge case refused in both modes, peak RSS growth bounded."""
    envs = {c.name: make_case(c, bases, tmp_path / "huge" / c.name) for c in HUGE}
    before = {name: snapshot(env.outside) for name, env in envs.items()}
    script = Path(__file__).with_name("hostile_stores.py")
    done = subprocess.run([sys.executable, str(script), *(str(e.root) for e in envs.values())],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    for row in report["results"]:
        assert row["kind"] == "InvalidStoreError", row
        assert row["message"] and "\n" not in row["message"]
        assert row["seconds"] < HANG_GUARD_SECONDS, row
    assert len(report["results"]) == 2 * len(HUGE)
    assert report["rss_growth_mib"] < MAX_RSS_GROWTH_MIB, report["rss_growth_mib"]
    assert report["traced_peak_mib"] < MAX_RSS_GROWTH_MIB, report["traced_peak_mib"]
    for name, env in envs.items():
        assert not env.canary.exists() and snapshot(env.outside) == before[name], name
    STATS["huge"] = (len(HUGE), report["rss_growth_mib"], report["traced_peak_mib"],
                     max(r["seconds"] for r in report["results"]))


def test_corpus_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """Summary of the corpus run above (printed with -s); every open was refused."""
    if STATS["opens"] == 0:
        pytest.skip("run with the corpus tests")
    assert STATS["refused"] == STATS["opens"]
    with capsys.disabled():
        print(f"\nhostile corpus: {len(CASES)} stores ({len(HUGE)} huge), {STATS['opens']} "
              f"in-process opens, {STATS['refused']} refused, slowest "
              f"{STATS['slowest'] * 1000:.0f} ms ({STATS['slowest_case']}); huge cases "
              f"(count, RSS growth MiB, traced peak MiB, slowest s): {STATS.get('huge')}")


# -- the corpus can fail: controls --------------------------------------------------------
def test_controls_valid_stores_open_and_the_canary_is_live(bases: dict[str, Path],
                                                           tmp_path: Path) -> None:
    for path in bases.values():  # read-only: the bases must stay as they are
        assert open_outcome(path, "r")[0] == "opened"
    env = Env(root=tmp_path, outside=tmp_path, canary=tmp_path / "canary")
    (tmp_path / "pickled.npy").write_bytes(canary_npy(env, "x"))
    np.load(tmp_path / "pickled.npy", allow_pickle=True)  # what a careless loader would do
    assert env.canary.exists()


def test_controls_reads_and_writes_outside_are_seen(tmp_path: Path, atime_works: bool) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"data")
    before = snapshot(outside)
    age_atimes(outside)
    times = atimes(outside)
    (outside / "f").read_bytes()
    assert atimes(outside) != times or not atime_works
    (outside / "f").write_bytes(b"DATA")
    assert snapshot(outside) != before


def test_ram_cap_is_configurable(bases: dict[str, Path]) -> None:
    with pytest.raises(InvalidStoreError, match="max_ram_bytes"):
        ReplayStore.open(bases["uniform"], "r", max_ram_bytes=1000)
    ReplayStore.open(bases["uniform"], "r", max_ram_bytes=10 << 20).close()


@pytest.mark.parametrize("codec, level", [("zstd", -2), ("lz4", 3)])
@pytest.mark.parametrize("dtype", ["uint8", "int8", "uint16", "int16", "uint32", "int32",
                                   "uint64", "int64", "float16", "float32", "float64", "bool"])
def test_zarr_metadata_of_every_allowed_dtype_is_accepted(tmp_path: Path, dtype: str,
                                                          codec: str, level: int) -> None:
    """The check is exact, so it must accept what zarr writes for every dtype and codec."""
    ReplayStore.create(tmp_path / "s", capacity=8, obs_shape=(3, 2), obs_dtype=dtype,
                       codec=codec, codec_level=level).close()
    ReplayStore.open(tmp_path / "s", "r").close()
    ReplayStore.open(tmp_path / "s").close()


def test_cli_reports_a_hostile_store_in_one_line(bases: dict[str, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    picked = [c for c in CASES if c.name in ("manifest-garbage-0", "link-root", "fifo-block",
                                              "npy-block-pickle-canary", "zarr-codecs-0")]
    assert len(picked) == 5
    for case in picked:
        env = make_case(case, bases, tmp_path / case.name)
        code = main(["info", str(env.root)])
        err = capsys.readouterr().err
        assert code == 2, case.name
        assert len(err.strip().splitlines()) == 1 and err.startswith("mmreplay: error: "), err
        assert not env.canary.exists()


# -- fuzzing the parsers ------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=25)
FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def only_invalid_store_error(fn: Any, *args: Any) -> None:
    """Call fn; success or InvalidStoreError (one line) are fine, anything else fails."""
    try:
        fn(*args)
    except InvalidStoreError as exc:
        assert str(exc) and "\n" not in str(exc)
        event("refused")
    else:
        event("accepted")


def full_check(data: bytes) -> None:
    m = parse_manifest(data)
    spec = parse_spec(m)
    check_ram(spec, 1 << 30)
    check_manifest(m, spec)


@pytest.fixture(scope="module")
def valid_manifest(bases: dict[str, Path]) -> dict[str, Any]:
    return manifest(bases["uniform"])


def field_paths(m: dict[str, Any]) -> list[tuple[Any, ...]]:
    paths: list[tuple[Any, ...]] = [(k,) for k in m]
    for key in ("spec", "rng", "files"):
        paths += [(key, k) for k in m[key]]
    paths += [("rng", "state", k) for k in m["rng"]["state"]]
    for key in ("written", "kept_from", "running", "blocks"):
        paths += [(key, i) for i in range(len(m[key]))]
    return paths


def replaced(m: dict[str, Any], path: tuple[Any, ...], value: Any) -> bytes:
    m = json.loads(json.dumps(m))
    node = m
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    body = {k: v for k, v in m.items() if k != "checksum"}
    return json.dumps({**body, "checksum": manifest_checksum(body)}).encode()


@pytest.mark.integration  # hypothesis fuzzing
@FUZZ
@given(data=st.binary(max_size=3000))
def test_fuzz_manifest_bytes(data: bytes) -> None:
    only_invalid_store_error(full_check, data)


@pytest.mark.integration  # hypothesis fuzzing
@FUZZ
@given(value=JSON)
def test_fuzz_manifest_json_values(value: Any) -> None:
    only_invalid_store_error(full_check, json.dumps(value).encode())


@pytest.mark.integration  # hypothesis fuzzing
@FUZZ
@given(data=st.data(), value=JSON)
def test_fuzz_manifest_fields(valid_manifest: dict[str, Any], data: st.DataObject,
                              value: Any) -> None:
    path = data.draw(st.sampled_from(field_paths(valid_manifest)))
    only_invalid_store_error(full_check, replaced(valid_manifest, path, value))


@pytest.fixture(scope="module")
def fuzz_store(bases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz") / "store"
    shutil.copytree(bases["uniform"], root)
    return root


@pytest.mark.integration  # hypothesis fuzzing
@FUZZ
@given(data=st.data(), value=JSON)
def test_fuzz_open_with_one_field_replaced(fuzz_store: Path, valid_manifest: dict[str, Any],
                                          data: st.DataObject, value: Any) -> None:
    """The whole open path, read-only, on a store whose manifest has one field replaced."""
    path = data.draw(st.sampled_from(field_paths(valid_manifest)))
    (fuzz_store / "manifest.json").write_bytes(replaced(valid_manifest, path, value))
    try:
        ReplayStore.open(fuzz_store, "r").close()
    except InvalidStoreError as exc:
        assert "\n" not in str(exc)
        event("refused")
    else:
        event("opened")


@pytest.fixture(scope="module")
def frames_meta_and_spec(bases: dict[str, Path]) -> tuple[dict[str, Any], Any]:
    meta = json.loads((bases["uniform"] / "frames" / "zarr.json").read_text())
    return meta, parse_spec(manifest(bases["uniform"]))


@pytest.mark.integration  # hypothesis fuzzing
@FUZZ
@given(data=st.binary(max_size=3000))
def test_fuzz_zarr_json_bytes(frames_meta_and_spec: tuple[dict[str, Any], Any],
                              data: bytes) -> None:
    spec = frames_meta_and_spec[1]
    only_invalid_store_error(lambda: check_frames_meta(parse_json(data, "zarr.json"), spec))


@pytest.mark.integration  # hypothesis fuzzing
@FUZZ
@given(data=st.data(), value=JSON)
def test_fuzz_zarr_json_fields(frames_meta_and_spec: tuple[dict[str, Any], Any],
                               data: st.DataObject, value: Any) -> None:
    meta, spec = frames_meta_and_spec
    key = data.draw(st.sampled_from([*meta, "codecs", "extra"]))
    changed = {**meta, key: value}
    try:
        check_frames_meta(changed, spec)
    except InvalidStoreError as exc:
        assert "\n" not in str(exc)
    else:  # accepted: only harmless fields may differ
        assert key in ("attributes", "dimension_names", "fill_value") or changed == meta


@pytest.fixture(scope="module")
def npy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("npy")
    (root / "steps").mkdir()
    return root


def load_fuzzed(root: Path, data: bytes) -> None:
    (root / "steps" / "b.npy").write_bytes(data)
    only_invalid_store_error(lambda: load_npy(root, "steps/b.npy", zlib.crc32(data),
                                              dtype=np.dtype("<f8"), shape=(2, 3)))


@pytest.mark.integration  # hypothesis fuzzing
@FUZZ
@given(data=st.binary(max_size=400))
def test_fuzz_npy_bytes(npy_dir: Path, data: bytes) -> None:
    load_fuzzed(npy_dir, npy_format.magic(1, 0) + data if len(data) % 2 else data)


@pytest.mark.integration  # hypothesis fuzzing
@FUZZ
@given(header=st.one_of(
    st.text(max_size=200),
    st.fixed_dictionaries({"descr": JSON | st.sampled_from(["<f8", "|O", "<u1", "V8"]),
                           "fortran_order": st.booleans() | JSON,
                           "shape": st.tuples(st.integers(), st.integers()) | JSON}).map(repr)),
    version=st.sampled_from([(1, 0), (2, 0), (3, 0)]), payload=st.binary(max_size=64))
def test_fuzz_npy_headers(npy_dir: Path, header: str, version: tuple[int, int],
                          payload: bytes) -> None:
    """Arbitrary header text through numpy's header parser (literal_eval, tokenize, dtype)."""
    try:
        data = npy_header(header, payload, version)
    except (UnicodeEncodeError, OverflowError):
        return  # not representable in a .npy header
    load_fuzzed(npy_dir, data)


def test_errors_are_mmreplay_and_value_errors() -> None:
    assert issubclass(InvalidStoreError, MmreplayError)
    assert issubclass(InvalidStoreError, ValueError)
    start = time.perf_counter()
    with pytest.raises(InvalidStoreError):
        parse_manifest(b"[" * 10_000_000)
    assert time.perf_counter() - start < HANG_GUARD_SECONDS
