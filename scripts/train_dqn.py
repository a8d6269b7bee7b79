"""DQN whose replay memory is a disk-backed `ReplayStore`, on ALE games or vector-observation envs.

    python scripts/train_dqn.py             # 20k-step Breakout demo: ~5 min on 2 busy CPU cores
    python scripts/train_dqn.py --resume    # continue runs/ALE-Breakout-v5-0 from its checkpoint
    python scripts/train_dqn.py --env CartPole-v1 --learning-rate 1e-3 --buffer-size 10000 \\
        --target-network-frequency 500 --batch-size 64 --n-step 3 --exploration-fraction 0.1 \\
        --end-e 0.05 --learning-starts 1000 --total-timesteps 100000 --stop-at-return 195

(the CartPole line solves it, a mean return >= 195 over 20 episodes, in 9k-26k steps for seeds
0-15). A real Atari run wants cleanrl's budget: ``--total-timesteps 10000000 --buffer-size
1000000 --learning-starts 80000 --exploration-fraction 0.1``.

cleanrl's `dqn_atari.py`/`dqn.py` with the replay buffer swapped for mmreplay. ALE games use
``AtariPreprocessing`` over ``gym.make(env, frameskip=1)`` (84x84 grayscale, frame skip 4, up to
30 no-op starts, a life loss is not a terminal) and *no* env-side frame stacking: the store keeps
every frame once and stacks 4 of them when it samples; the agent keeps its own last 4 frames per
env to act. Atari rewards are sign-clipped before they are stored; returns are logged unclipped.

The run directory holds ``store/`` (the ReplayStore), ``checkpoint.pt`` (networks, optimizer and
counters: tensors and plain numbers, loaded with ``weights_only=True``), ``episodes.csv``,
``learning_curve.png`` and ``summary.json``. Checkpoints are a two-phase commit whose commit point
is the store's own manifest:

    1. write checkpoint.pt.pending   (model + the store's transition count T)
    2. store.flush()                 (the store now commits T transitions)
    3. os.replace(pending, checkpoint.pt)

The store is flushed nowhere else (its final `close` follows the last checkpoint), and its other
commits (giving up old frames on ring wraparound) never add transitions, so on ``--resume`` the
store's T is recorded by checkpoint.pt or, after a crash between 2 and 3, by the complete pending
file, which is then promoted.

``--store s3://bucket/prefix`` mirrors the run there (docs/object-storage.md): the store at
``PREFIX/store`` (its mirror pushes each commit in the background), the checkpoint files beside
it, uploaded in the same two phases (the pending file before the flush, which waits for the
mirror; the final file after the rename). On a machine that never saw the run,

    python scripts/train_dqn.py --resume --run-dir runs/new --store s3://bucket/prefix

brings the newest complete store generation and the checkpoint files down into the empty run
directory and continues exactly as a local ``--resume`` would, mirroring back to the prefix.
"""

from __future__ import annotations

import csv
import json
import os
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ale_py
import gymnasium as gym
import matplotlib
import numpy as np
import torch
import tyro
from common import (
    Learner,
    QNetwork,
    RunBucket,
    StopFlag,
    StoreArgs,
    UsageError,
    crossed,
    dir_bytes,
    is_atari,
    linear_schedule,
    make_env,
    on_interrupt,
    prepare_run,
    push_frames,
    resume_command,
    run_main,
)
from tqdm import tqdm

from mmreplay import ReplayStore
from mmreplay.lifecycle import untrack

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)

gym.register_envs(ale_py)


@dataclass
class Args(StoreArgs):
    env: str = "ALE/Breakout-v5"
    """gymnasium id: an ALE game (`ALE/<Game>-v5`) or a vector-observation env (`CartPole-v1`)"""
    seed: int = 0
    """seed of the envs, the network init, exploration and the store's sampler"""
    run_dir: str = ""
    """run directory (store, checkpoint, curve); empty means `runs/<env>-<seed>`"""
    resume: bool = False
    """continue the run in `run_dir` from its last checkpoint"""
    overwrite: bool = False
    """delete `run_dir` first if it already holds a run (without `--resume`)"""
    total_timesteps: int = 20_000
    """env steps in all (summed over envs); the default is a short demo, not a real Atari run"""
    num_envs: int = 1
    """envs stepped in lockstep by a `SyncVectorEnv` (next-step autoreset)"""
    buffer_size: int = 100_000
    """replay capacity in frames (about one frame per transition); split evenly over envs"""
    learning_rate: float = 1e-4
    """Adam learning rate"""
    gamma: float = 0.99
    """discount factor"""
    n_step: int = 1
    """n-step returns: the store sums n rewards and discounts the bootstrap by gamma^m"""
    target_network_frequency: int = 1000
    """env steps between copies of the online network into the target network"""
    batch_size: int = 32
    """transitions per gradient step"""
    start_e: float = 1.0
    """exploration epsilon at the start"""
    end_e: float = 0.01
    """exploration epsilon after the linear decay"""
    exploration_fraction: float = 0.5
    """fraction of `total_timesteps` over which epsilon decays from `start_e` to `end_e`"""
    learning_starts: int = 5_000
    """env steps before the first gradient step"""
    train_frequency: int = 4
    """env steps between gradient steps"""
    prioritized: bool = False
    """prioritized replay (proportional): sample by |TD error|, weight the loss"""
    alpha: float = 0.6
    """prioritization exponent (with `--prioritized`)"""
    beta: float = 0.4
    """initial importance-weight exponent, annealed linearly to 1 (with `--prioritized`)"""
    torch_threads: int = 1
    """torch intra-op threads, 0 for torch's default (all cores): acting, learning and the envs
    take turns in one thread, and on a small or shared CPU extra threads mostly spin"""
    checkpoint_every: int = 10_000
    """env steps between checkpoints (store flush + model file)"""
    stop_at_return: float = float("inf")
    """stop early once the mean return of the last `return_window` episodes reaches this"""
    return_window: int = 20
    """episodes in the mean return shown and compared with `stop_at_return`"""
    progress_every: float = 1.0
    """seconds between updates of the progress bar's episodes, return and rate"""


def for_store(obs: np.ndarray) -> np.ndarray:
    """Vector-env observations as `store.reset`/`add` take them: a store with one env takes
    one unbatched observation (its actions, rewards and flags may keep the env dimension)."""
    return obs[0] if obs.shape[0] == 1 else obs


def save_checkpoint(run_dir: Path, store: ReplayStore, state: dict[str, Any],
                    bucket: RunBucket | None = None) -> None:
    """Two-phase commit of model + store (module docstring): pending, flush, rename. With
    `bucket` the bucket gets the same phases: the pending file goes up before the flush,
    which waits until the store's mirror has pushed it, then the final file."""
    pending = run_dir / "checkpoint.pt.pending"
    torch.save({**state, "transitions": store.counts.transitions}, pending)
    if bucket is not None:
        bucket.upload(run_dir, pending.name)
    store.flush(wait_mirror=bucket is not None)
    os.replace(pending, run_dir / "checkpoint.pt")
    if bucket is not None:
        bucket.upload(run_dir, "checkpoint.pt")


def load_checkpoint(run_dir: Path, transitions: int) -> dict[str, Any]:
    """The checkpoint that belongs to a store holding `transitions`, promoting a pending one."""
    final, pending = run_dir / "checkpoint.pt", run_dir / "checkpoint.pt.pending"
    found = []
    for path in (final, pending):
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):  # absent or cut short
            continue
        found.append(ckpt["transitions"])
        if ckpt["transitions"] == transitions:
            if path == pending:
                os.replace(pending, final)
            pending.unlink(missing_ok=True)
            return ckpt
    raise SystemExit(f"{run_dir}: the store holds {transitions} transitions but the "
                     f"checkpoints record {found}; cannot resume consistently")


def write_logs(run_dir: Path, episodes: dict[str, list[Any]], window: int) -> None:
    """episodes.csv and learning_curve.png from the episode log."""
    with open(run_dir / "episodes.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["episode", "global_step", "return", "length"])
        for i, row in enumerate(zip(episodes["step"], episodes["return"], episodes["length"],
                                    strict=True)):
            writer.writerow([i, *row])
    returns = np.asarray(episodes["return"], dtype=np.float64)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(episodes["step"], returns, ".", alpha=0.3, label="episode return")
    if returns.size >= window:
        mean = np.convolve(returns, np.ones(window) / window, mode="valid")
        ax.plot(episodes["step"][window - 1:], mean, label=f"mean of last {window}")
    ax.set_xlabel("env steps")
    ax.set_ylabel("return")
    ax.set_title(run_dir.name)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(run_dir / "learning_curve.png", dpi=100)
    plt.close(fig)


def mean_recent(episodes: dict[str, list[Any]], window: int) -> float:
    recent = episodes["return"][-window:]
    return float(np.mean(recent)) if recent else float("nan")


@dataclass
class Run:
    """What a run carries between steps and into its checkpoints."""

    args: Args
    run_dir: Path
    store: ReplayStore
    learner: Learner
    episodes: dict[str, list[Any]] = field(
        default_factory=lambda: {"step": [], "return": [], "length": []})
    global_step: int = 0
    saved_at: int = -1
    bucket: RunBucket | None = None  # `--store`: the run's copy in object storage

    def __post_init__(self) -> None:
        # The store commits only together with a checkpoint (two-phase, `save_checkpoint`):
        # an exit flush of steps past the last checkpoint would leave a store no checkpoint
        # matches, so this run, not the library's exit hook, decides when the store commits.
        untrack(self.store)

    def checkpoint(self) -> None:
        self.saved_at = self.global_step
        save_checkpoint(self.run_dir, self.store, {
            **self.learner.state(), "global_step": self.global_step,
            "episodes": self.episodes, "args": asdict(self.args)}, self.bucket)
        write_logs(self.run_dir, self.episodes, self.args.return_window)

    def recent_return(self) -> float:
        return mean_recent(self.episodes, self.args.return_window)


def make_envs(args: Args) -> gym.vector.SyncVectorEnv:
    envs = gym.vector.SyncVectorEnv([lambda: make_env(args.env) for _ in range(args.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    if not isinstance(envs.single_action_space, gym.spaces.Discrete):
        envs.close()
        raise UsageError(f"DQN needs discrete actions; {args.env} has "
                         f"{envs.single_action_space}")
    return envs


def open_run(args: Args, run_dir: Path, envs: gym.vector.SyncVectorEnv, frame_stack: int,
             bucket: RunBucket | None = None) -> Run:
    """A new run (store created, checkpoint at step 0) or the one in `run_dir` resumed; with
    `bucket` the store mirrors there, and comes down from there into an empty `run_dir`."""
    obs_space = envs.single_observation_space
    obs_shape: tuple[int, ...] = obs_space.shape or ()
    learner = Learner.create((frame_stack, *obs_shape), int(envs.single_action_space.n),
                             args.learning_rate)
    sampler = "prioritized" if args.prioritized else "uniform"
    if not args.resume:
        store = ReplayStore.create(
            run_dir / "store", capacity=args.buffer_size, obs_shape=obs_shape,
            obs_dtype=obs_space.dtype, num_envs=args.num_envs, frame_stack=frame_stack,
            n_step=args.n_step, gamma=args.gamma, seed=args.seed, sampler=sampler,
            alpha=args.alpha, mirror=None if bucket is None else bucket.store_url)
        run = Run(args, run_dir, store, learner, bucket=bucket)
        run.checkpoint()  # step 0: a run directory is always resumable
        return run
    if bucket is None:
        store = ReplayStore.open(run_dir / "store")
    else:  # brought down from the bucket unless run_dir holds it, then mirrored back
        store = ReplayStore.open(bucket.store_url, "r+", local=run_dir / "store",
                                 take_over=args.take_over)
    spec, want = store.spec, (args.num_envs, frame_stack, args.n_step, args.gamma, sampler)
    have = (spec.num_envs, spec.frame_stack, spec.n_step, spec.gamma, spec.sampler)
    if have != want:
        store.close()
        raise UsageError(f"store (num_envs, frame_stack, n_step, gamma, sampler) = {have} "
                         f"but the arguments ask for {want}")
    ckpt = load_checkpoint(run_dir, store.counts.transitions)
    learner.load(ckpt)
    tqdm.write(f"resumed at step {ckpt['global_step']} with {ckpt['transitions']} transitions "
               f"in the store")
    return Run(args, run_dir, store, learner, ckpt["episodes"], int(ckpt["global_step"]),
               int(ckpt["global_step"]), bucket)


class Actors:
    """The vector env and, per env, the agent's own stack of its last frames and the running
    episode's return and length. Envs restart fresh (on resume too: `store.reset` ends the
    episodes the last checkpoint left running as truncated); seeds move with the step."""

    def __init__(self, envs: gym.vector.SyncVectorEnv, run: Run, frame_stack: int) -> None:
        n, space = run.args.num_envs, envs.single_observation_space
        self.envs, self.atari = envs, is_atari(run.args.env)
        self.num_actions = int(envs.single_action_space.n)
        self.rng = np.random.default_rng([run.args.seed, run.global_step])
        obs, _ = envs.reset(seed=run.args.seed + run.global_step)
        run.store.reset(for_store(obs))
        self.stack = np.zeros((n, frame_stack, *(space.shape or ())), dtype=space.dtype)
        push_frames(self.stack, obs, np.ones(n, dtype=bool))
        self.autoreset = np.zeros(n, dtype=bool)
        self.ep_return, self.ep_length = np.zeros(n), np.zeros(n, dtype=np.int64)

    def step(self, q: QNetwork, store: ReplayStore, epsilon: float) -> list[tuple[float, int]]:
        """One epsilon-greedy step of every env, recorded; (return, length) of each episode
        that ended. Envs flagged `autoreset` ignore the action and return a new o_0."""
        n = len(self.autoreset)
        with torch.no_grad():
            greedy = q(torch.from_numpy(self.stack)).argmax(1).numpy()
        explore = self.rng.random(n) < epsilon
        actions = np.where(explore, self.rng.integers(self.num_actions, size=n), greedy)
        next_obs, rewards, terminated, truncated, _ = self.envs.step(actions)
        stored_rewards = np.sign(rewards) if self.atari else rewards  # returns stay unclipped
        store.add(actions, stored_rewards, for_store(next_obs), terminated, truncated,
                  autoreset=self.autoreset)
        push_frames(self.stack, next_obs, self.autoreset)
        self.ep_return += np.where(self.autoreset, 0.0, rewards)
        self.ep_length += ~self.autoreset
        done = terminated | truncated
        ended = [(float(self.ep_return[i]), int(self.ep_length[i])) for i in np.flatnonzero(done)]
        self.ep_return[done], self.ep_length[done] = 0.0, 0
        self.autoreset = done
        return ended


class Progress:
    """The tqdm bar; its postfix (episodes, return, epsilon, rate, disk) is shown every
    `every` seconds from step 0, the disk figure rescanned at most every 10 s."""

    def __init__(self, run: Run) -> None:
        self.run, self.every = run, run.args.progress_every
        self.bar = tqdm(total=run.args.total_timesteps, initial=run.global_step, unit="step",
                        dynamic_ncols=True)
        self.shown = (time.time(), run.global_step)
        self.disk_at, self.disk_mib = 0.0, 0.0

    def update(self, steps: int, epsilon: float) -> None:
        self.bar.update(steps)
        now, step = time.time(), self.run.global_step
        if now - self.shown[0] < self.every:
            return
        if now - self.disk_at >= 10.0:  # scanning a big store's files takes a while
            self.disk_at, self.disk_mib = now, dir_bytes(self.run.run_dir / "store") / 2**20
        self.bar.set_postfix(
            episodes=len(self.run.episodes["return"]), ret=f"{self.run.recent_return():.1f}",
            eps=f"{epsilon:.2f}", sps=int((step - self.shown[1]) / max(now - self.shown[0], 1e-9)),
            disk=f"{self.disk_mib:.1f}MiB", refresh=False)
        self.shown = (now, step)


def train(run: Run, actors: Actors, stop: StopFlag) -> int | None:
    """Act, record and learn until `total_timesteps`, a stop signal or `stop_at_return`;
    returns the step at which `stop_at_return` was reached, if it was."""
    args, learner = run.args, run.learner
    progress = Progress(run)
    while run.global_step < args.total_timesteps and not stop:
        epsilon = linear_schedule(args.start_e, args.end_e,
                                  args.exploration_fraction * args.total_timesteps,
                                  run.global_step)
        ended = actors.step(learner.q, run.store, epsilon)
        before = run.global_step
        run.global_step += args.num_envs
        for ret, length in ended:
            run.episodes["step"].append(run.global_step)
            run.episodes["return"].append(ret)
            run.episodes["length"].append(length)
        if run.global_step > args.learning_starts:
            beta = linear_schedule(args.beta, 1.0, args.total_timesteps, run.global_step)
            for _ in range(crossed(before, run.global_step, args.train_frequency)):
                batch = run.store.sample(args.batch_size, beta=beta)
                td_error = learner.update(batch)
                if args.prioritized:
                    run.store.update_priorities(batch.ids, td_error.numpy())
            if crossed(before, run.global_step, args.target_network_frequency):
                learner.sync_target()
        if crossed(before, run.global_step, args.checkpoint_every):
            run.checkpoint()
        progress.update(run.global_step - before, epsilon)
        if len(run.episodes["return"]) >= args.return_window \
                and run.recent_return() >= args.stop_at_return:
            progress.bar.close()
            return run.global_step
    progress.bar.close()
    return None


def finish(run: Run, solved_at: int | None, interrupted: bool, started: tuple[float, int]
           ) -> dict[str, Any]:
    """The last checkpoint, the store closed, summary.json written; returns the summary."""
    if run.saved_at != run.global_step:
        run.checkpoint()
    wall = time.time() - started[0]
    store_dir = run.run_dir / "store"
    summary = {
        "env": run.args.env, "seed": run.args.seed, "global_step": run.global_step,
        "episodes": len(run.episodes["return"]), "mean_return": run.recent_return(),
        "solved_at_step": solved_at, "interrupted": interrupted, "wall_seconds": wall,
        "steps_per_second": (run.global_step - started[1]) / max(wall, 1e-9),
        "store_bytes": dir_bytes(store_dir), "store_transitions": run.store.counts.transitions,
    }
    run.store.close()  # a mirror pushes its last generation first
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if run.bucket is not None:
        run.bucket.upload(run.run_dir, "summary.json")
    tqdm.write(f"stopped at step {run.global_step}: " + json.dumps(summary))
    return summary


def main() -> int:
    args = tyro.cli(Args, description=__doc__)
    frame_stack = 4 if is_atari(args.env) else 1
    run_dir, bucket = prepare_run(Path(args.run_dir or f"runs/{args.env.replace('/', '-')}-"
                                       f"{args.seed}"), resume=args.resume,
                                  overwrite=args.overwrite, store=args.store)
    again = resume_command(run_dir, store=args.store)
    stop = StopFlag()
    torch.manual_seed(args.seed)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    envs = make_envs(args)
    run = open_run(args, run_dir, envs, frame_stack, bucket)
    # A second Ctrl-C stops at once. The store is left unflushed: its committed transitions
    # stay those of the last checkpoint, which is where the run resumes.
    on_interrupt(lambda: None, message=f"to continue from the last checkpoint: {again}")
    actors = Actors(envs, run, frame_stack)
    started = (time.time(), run.global_step)
    solved_at = train(run, actors, stop)
    envs.close()
    finish(run, solved_at, bool(stop), started)
    return stop.exit_status(again)


if __name__ == "__main__":
    run_main(main)
