"""The scripts as a user meets them at the command line: `--help`, argument errors, run
directories that already hold a run, ordinary mistakes and Ctrl-C (one test per defect of
the first-contact report), and the shared module `scripts/common.py` they stand on."""

from __future__ import annotations

import json
import os
import re
import runpy
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from script_runner import Outcome as ScriptRun
from script_runner import run_here

from mmreplay import ReplayStore

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
TRAINING = ["train_dqn.py", "apex_dqn.py", "sb3_dqn.py", "train_r2d2.py", "train_offline.py",
            "record_atari.py"]
BENCH = [f"bench/{name}" for name in (
    "bench.py", "bench_scale.py", "bench_sequences.py", "bench_prioritized.py", "bench_ray.py",
    "bench_datasets.py", "bench_prefetch.py", "bench_overhead.py", "sb3_parity.py")]
CARTPOLE_DQN = ["--env", "CartPole-v1", "--learning-rate", "1e-3", "--buffer-size", "2000",
                "--batch-size", "16", "--learning-starts", "100", "--target-network-frequency",
                "100"]


def script_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
            "RAY_USAGE_STATS_ENABLED": "0"}


def run(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], env=script_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def assert_one_line_error(proc: subprocess.CompletedProcess[str] | ScriptRun,
                          *words: str) -> None:
    """Exit status 2, one line on stderr naming `words`, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def help_sections(help_text: str) -> tuple[str, dict[str, str]]:
    """A `--help` text's description, and each of its options with its help keyed by its
    first flag. tyro lays the options out under an ``options`` title, in a box on a
    terminal, one row per line, an option's help continued on indented rows."""
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if box_text(line) == "options")
    found: dict[str, str] = {}
    flag = None
    for line in lines[start + 1:]:
        row = line.replace("│", " ").rstrip()
        words = row.split()
        if not words or set(row.strip()) <= set("-─╭╮╰╯"):
            continue
        if len(row) - len(row.lstrip()) <= 3 and words[0].startswith("-"):
            flag = words[0].rstrip(",")
            found[flag] = " ".join(words)
        elif flag is not None:
            found[flag] += " " + " ".join(words)
    return "\n".join(lines[:start]), found


def options(help_text: str) -> dict[str, str]:
    """Each option of a `--help` text with its help, keyed by its first flag."""
    return help_sections(help_text)[1]


def box_text(text: str) -> str:
    """What tyro's message box says, as one line of words (its frame and wrapping gone)."""
    return " ".join(text.translate(str.maketrans("", "", "│╭╮╰╯─")).split())


# -- --help, --flag=value, argument errors -------------------------------------------------------


@dataclass
class Outcome:
    code: int
    out: str
    err: str


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """Run `scripts/<name> args...` as `__main__` in this process (its imports are then
    paid once per test session): what a command line that stops at argument parsing does."""

    def go(name: str, *args: str) -> Outcome:
        monkeypatch.setattr(sys, "argv", [str(SCRIPTS / name), *args])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(SCRIPTS / name), run_name="__main__")
        captured = capsys.readouterr()
        code = exit_info.value.code
        return Outcome(code if isinstance(code, int) else 1, captured.out, captured.err)

    return go


def assert_argument_error(outcome: Outcome, *words: str) -> None:
    """An argument tyro refuses: exit status 2, a short message naming `words`, no
    traceback."""
    assert outcome.code == 2, (outcome.code, outcome.err[-2000:])
    assert "Traceback" not in outcome.err and len(outcome.err.splitlines()) < 20, outcome.err
    for word in words:
        assert word in box_text(outcome.err), (word, outcome.err)


def assert_one_line(outcome: Outcome, *words: str) -> None:
    assert outcome.code == 2, (outcome.code, outcome.err[-2000:])
    lines = outcome.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in outcome.err, outcome.err[-2000:]
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("name", TRAINING + BENCH)
def test_help_shows_every_option_with_its_text_and_default(in_process, name: str) -> None:
    if name in ("apex_dqn.py", "bench/bench_ray.py"):
        pytest.importorskip("ray")
    if "sb3" in name:
        pytest.importorskip("stable_baselines3")
    shown = in_process(name, "--help")
    assert shown.code == 0, shown.err[-2000:]
    found = options(shown.out)
    assert "-h" in found and len(found) > 3, shown.out
    for flag, text in found.items():
        if flag == "-h":
            continue
        assert "(default: " in text, (flag, text)
        assert len(text.split("(default: ")[0].split()) > 2, (flag, text)  # some words
    description = help_sections(shown.out)[0]
    assert "\\" not in description.replace("\\\n", ""), description  # no stray escapes
    assert re.search(r"\n    python scripts/", description), description  # examples as laid out


@pytest.mark.integration
def test_sb3_dqn_takes_flag_equals_value_and_refuses_a_second_run(tmp_path: Path) -> None:
    """--seed=1 is accepted; a re-run into the run dir trains nothing and changes nothing."""
    pytest.importorskip("stable_baselines3")
    args = ["--total-timesteps=256", "--learning-starts", "1000", "--eval-episodes=0",
            "--run-dir", str(tmp_path)]
    first = run_here("sb3_dqn.py", "--seed=1", *args, torch_threads=1)
    assert first.returncode == 0, first.stderr[-2000:]
    result = (tmp_path / "result.json").read_text()
    assert json.loads(result)["seed"] == 1 and json.loads(result)["buffer_transitions"] == 256

    again = run_here("sb3_dqn.py", "--seed=1", *args)
    assert_one_line_error(again, str(tmp_path), "--resume or --overwrite")
    assert (tmp_path / "result.json").read_text() == result
    with ReplayStore.open(tmp_path / "store", mode="r") as store:
        assert store.counts.transitions == 256


@pytest.mark.parametrize("name", ["sb3_dqn.py", "train_dqn.py", "train_r2d2.py"])
@pytest.mark.parametrize("value", [[], ["abc"]], ids=["missing", "not-an-int"])
def test_a_bad_value_is_a_short_message_and_exit_2(in_process, name: str, value: list[str]) -> None:
    flag = "--total-steps" if name == "train_r2d2.py" else "--total-timesteps"
    outcome = in_process(name, "--seed=1", flag, *value)
    assert_argument_error(outcome, flag, "Missing value for argument" if not value
                          else "invalid literal for int() with base 10: 'abc'")


def test_an_unknown_flag_is_a_short_message_and_exit_2(in_process) -> None:
    assert_argument_error(in_process("sb3_dqn.py", "--no-such-flag", "1"),
                          "Unrecognized options: --no-such-flag")


@pytest.mark.integration
def test_a_bad_value_from_a_real_command_line() -> None:
    """The same, as a user's shell runs it: a fresh interpreter, no traceback."""
    proc = run("sb3_dqn.py", "--total-timesteps", timeout=120)
    assert_argument_error(Outcome(proc.returncode, proc.stdout, proc.stderr),
                          "--total-timesteps", "Missing value for argument")


# -- run directories and ordinary mistakes --------------------------------------------------------


@pytest.mark.integration
def test_train_r2d2_refuses_a_run_dir_that_holds_a_run(tmp_path: Path) -> None:
    ReplayStore.create(tmp_path / "store", capacity=64, obs_shape=(2,), seed=0).close()
    (tmp_path / "summary.json").write_text("{}")
    proc = run_here("train_r2d2.py", "--run-dir", str(tmp_path), "--total-steps", "8")
    assert_one_line_error(proc, str(tmp_path), "--overwrite")
    assert (tmp_path / "summary.json").read_text() == "{}"

    again = run_here("train_r2d2.py", "--run-dir", str(tmp_path), "--total-steps", "40",
                "--learning-starts", "1000", "--num-envs", "2", "--hidden", "4", "--overwrite")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 40


def test_train_dqn_resume_of_a_missing_run_is_one_line(in_process, tmp_path: Path) -> None:
    outcome = in_process("train_dqn.py", "--resume", "--run-dir", str(tmp_path / "none"))
    assert_one_line(outcome, str(tmp_path / "none"), "no run to resume")
    assert not (tmp_path / "none").exists()


def test_an_unknown_env_id_is_one_line(in_process, tmp_path: Path) -> None:
    outcome = in_process("train_dqn.py", "--env", "NoSuchGame-v0", "--run-dir",
                         str(tmp_path / "run"))
    assert_one_line(outcome, "unknown environment id 'NoSuchGame-v0'")
    assert not (tmp_path / "run").exists()


@pytest.mark.integration
def test_apex_dqn_checks_the_run_dir_before_starting_ray(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    (tmp_path / "checkpoint.pt").write_bytes(b"a run")
    started = time.monotonic()
    proc = run("apex_dqn.py", "--env", "CartPole-v1", "--run-dir", str(tmp_path), timeout=120)
    assert_one_line_error(proc, "--resume or --overwrite")
    print(f"refused in {time.monotonic() - started:.1f} s")  # no cluster was started


def test_train_offline_without_a_store_is_one_line(in_process, tmp_path: Path) -> None:
    assert_one_line(in_process("train_offline.py", "--algo", "cql"), "--store")
    missing = in_process("train_offline.py", "--store", str(tmp_path / "nope"),
                         "--run-dir", str(tmp_path / "run"))
    assert_one_line(missing, str(tmp_path / "nope"))


# -- Ctrl-C --------------------------------------------------------------------------------------


def checkpoint_step(run_dir: Path) -> int:
    try:
        return int(torch.load(run_dir / "checkpoint.pt", weights_only=True)["global_step"])
    except (OSError, RuntimeError, EOFError, KeyError):
        return -1


@pytest.mark.integration
def test_ctrl_c_checkpoints_says_where_to_resume_and_exits_130(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "train_dqn.py"), *CARTPOLE_DQN, "--total-timesteps",
         "1000000", "--checkpoint-every", "200", "--run-dir", str(run_dir)],
        env=script_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while checkpoint_step(run_dir) < 200:  # past learning_starts: training has begun
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    hint = f"python scripts/train_dqn.py --resume --run-dir {run_dir}"
    assert hint in stderr, stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and 200 <= summary["global_step"] < 1_000_000
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert ckpt["global_step"] == summary["global_step"]
    with ReplayStore.open(run_dir / "store", mode="r") as store:
        assert store.counts.transitions == ckpt["transitions"] == summary["store_transitions"]

    resumed = run_here("train_dqn.py", *CARTPOLE_DQN, "--resume", "--run-dir", str(run_dir),
                       "--total-timesteps", str(summary["global_step"] + 50))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed at step {summary['global_step']}" in resumed.stdout


# -- the shared module, in process ---------------------------------------------------------------


@dataclass
class Example:
    total_steps: int = 10
    """how many steps"""
    rate: float = 0.5
    """a rate; 100% means all"""
    limit: int | None = None
    """an optional limit"""
    name: str = "x"
    """a name"""
    fast: bool = False
    """go fast"""


def test_args_dataclasses_parse_as_the_scripts_page_says(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """The conventions docs/scripts.md states, as `tyro.cli(Args)` gives them: kebab-case
    flags, ``--flag=value``, ``--x/--no-x`` booleans, ``X | None`` keeping its None default,
    exit 2 on a bad value, each field's docstring and default in `--help`."""
    import tyro

    assert tyro.cli(Example, args=[]) == Example()
    got = tyro.cli(Example, args=["--total-steps=3", "--rate", "0.25", "--limit", "7",
                                  "--name=y", "--fast"])
    assert got == Example(3, 0.25, 7, "y", True)
    assert tyro.cli(Example, args=["--fast", "--no-fast"]).fast is False
    with pytest.raises(SystemExit) as exit_info:
        tyro.cli(Example, args=["--total-steps", "x"])
    assert exit_info.value.code == 2
    assert "--total-steps" in box_text(capsys.readouterr().err)
    with pytest.raises(SystemExit) as exit_info:
        tyro.cli(Example, args=["--help"])
    assert exit_info.value.code == 0
    shown = options(capsys.readouterr().out)
    assert shown["--total-steps"].endswith("how many steps (default: 10)")
    assert shown["--rate"].endswith("a rate; 100% means all (default: 0.5)")
    assert shown["--limit"].endswith("an optional limit (default: None)")
    assert shown["--name"].endswith("a name (default: x)")
    assert shown["--fast"].endswith("go fast (default: False)")


def test_prepare_run_dir_refuses_resumes_and_overwrites(tmp_path: Path) -> None:
    from common import UsageError, prepare_run_dir

    run_dir = tmp_path / "run"
    assert prepare_run_dir(run_dir) == run_dir and run_dir.is_dir()
    assert prepare_run_dir(run_dir) == run_dir  # still empty: nothing to lose
    (run_dir / "result.json").write_text("{}")
    with pytest.raises(UsageError, match="pass --resume or --overwrite"):
        prepare_run_dir(run_dir)
    with pytest.raises(UsageError, match="pass --overwrite$"):
        prepare_run_dir(run_dir, resumable=False)
    assert prepare_run_dir(run_dir, resume=True) == run_dir
    assert (run_dir / "result.json").exists()
    prepare_run_dir(run_dir, overwrite=True)
    assert run_dir.is_dir() and not any(run_dir.iterdir())
    with pytest.raises(UsageError, match="holds no run to resume"):
        prepare_run_dir(tmp_path / "none", resume=True)
    with pytest.raises(UsageError, match="not both"):
        prepare_run_dir(run_dir, resume=True, overwrite=True)


@pytest.mark.integration
def test_run_main_exit_statuses(tmp_path: Path) -> None:
    """0, 2 for ordinary mistakes (one line), 130 after Ctrl-C (cleanup called), and a real
    bug keeps its traceback."""
    code = """
import sys
from common import UsageError, on_interrupt, run_main
from mmreplay.errors import InvalidStoreError
kind = sys.argv[1]
def main():
    on_interrupt(lambda: print("closed the store", file=sys.stderr), message="resume: here")
    if kind == "usage": raise UsageError("bad --thing")
    if kind == "store": raise InvalidStoreError("not a store")
    if kind == "missing": open("/nonexistent/file")
    if kind == "exit": raise SystemExit("a message")
    if kind == "ctrl-c": raise KeyboardInterrupt
    if kind == "bug": raise ZeroDivisionError("a bug")
    return 0
run_main(main)
"""
    base = script_env()
    env = {**base, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), base["PYTHONPATH"]])}

    def go(kind: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code, kind], env=env, capture_output=True,
                              text=True, timeout=120, check=False)

    assert go("ok").returncode == 0
    for kind, word in [("usage", "bad --thing"), ("store", "not a store"),
                       ("missing", "/nonexistent/file"), ("exit", "a message")]:
        assert_one_line_error(go(kind), word)
    interrupted = go("ctrl-c")
    assert interrupted.returncode == 130
    assert interrupted.stderr.splitlines()[:2] == ["closed the store", "resume: here"]
    bug = go("bug")
    assert bug.returncode == 1 and "Traceback" in bug.stderr
