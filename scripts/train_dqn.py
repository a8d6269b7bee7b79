"""DQN whose replay memory is a disk-backed `ReplayStore`, on ALE games or vector-observation envs.

    python scripts/train_dqn.py             # 20k-step Breakout demo: ~5 min on 2 busy CPU cores
    python scripts/train_dqn.py --resume    # continue runs/ALE-Breakout-v5-0 from its checkpoint
    python scripts/train_dqn.py --env CartPole-v1 --learning-rate 1e-3 --buffer-size 10000 \
        --target-network-frequency 500 --batch-size 64 --n-step 3 --exploration-fraction 0.1 \
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
"""

from __future__ import annotations

import argparse
import ast
import csv
import inspect
import json
import os
import pickle
import shutil
import signal
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import ale_py
import gymnasium as gym
import matplotlib
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from gymnasium.wrappers import AtariPreprocessing
from tqdm import tqdm

from mmreplay import ReplayStore

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)

gym.register_envs(ale_py)


@dataclass
class Args:
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


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, for `--help`."""
    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    return {
        node.target.id: str(doc.value.value)
        for node, doc in zip(body, body[1:], strict=False)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    }


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    docs = field_docs(Args)
    for f in fields(Args):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=docs.get(f.name))
        else:
            parser.add_argument(flag, type=type(default), default=default,
                                help=f"{docs.get(f.name)} (default: {default})")
    return Args(**vars(parser.parse_args()))


def is_atari(env_id: str) -> bool:
    return "ale_py" in str(gym.spec(env_id).entry_point)


def make_env(env_id: str) -> gym.Env:
    if not is_atari(env_id):
        return gym.make(env_id)
    env = gym.make(env_id, frameskip=1)
    return AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84,
                              terminal_on_life_loss=False, grayscale_obs=True)


class QNetwork(nn.Module):
    """Nature CNN for (stack, 84, 84) uint8 frames; a small MLP for flat vector observations."""

    def __init__(self, obs_shape: tuple[int, ...], num_actions: int) -> None:
        super().__init__()
        self.pixels = len(obs_shape) == 3
        if self.pixels:
            self.network = nn.Sequential(
                nn.Conv2d(obs_shape[0], 32, 8, stride=4), nn.ReLU(),
                nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
                nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
                nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(),
                nn.Linear(512, num_actions),
            )
        else:
            self.network = nn.Sequential(
                nn.Flatten(), nn.Linear(int(np.prod(obs_shape)), 120), nn.ReLU(),
                nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_actions),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() / 255.0 if self.pixels else x.float()
        return self.network(x)


def linear_schedule(start: float, end: float, duration: float, t: int) -> float:
    slope = (end - start) / max(duration, 1.0)
    return max(slope * t + start, end) if end < start else min(slope * t + start, end)


def crossed(before: int, now: int, every: int) -> int:
    """How many multiples of `every` lie in (before, now]."""
    return now // every - before // every


def push_frames(stack: np.ndarray, frames: np.ndarray, fresh: np.ndarray) -> None:
    """Shift each env's last-k frames left and append its new frame; `fresh` envs restart
    from zeros, the way the store pads stacks at an episode's start (stack_padding="zero")."""
    stack[fresh] = 0
    stack[:, :-1] = stack[:, 1:]
    stack[:, -1] = frames


def for_store(obs: np.ndarray) -> np.ndarray:
    """Vector-env observations as `store.reset`/`add` take them: a store with one env takes
    one unbatched observation (its actions, rewards and flags may keep the env dimension)."""
    return obs[0] if obs.shape[0] == 1 else obs


def dir_bytes(path: Path) -> int:
    """Sum of the sizes of the files under `path`."""
    total = 0
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            total += dir_bytes(Path(entry.path))
        elif entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_size
    return total


def save_checkpoint(run_dir: Path, store: ReplayStore, state: dict[str, Any]) -> None:
    """Two-phase commit of model + store (module docstring): pending, flush, rename."""
    pending = run_dir / "checkpoint.pt.pending"
    torch.save({**state, "transitions": store.counts.transitions}, pending)
    store.flush()
    os.replace(pending, run_dir / "checkpoint.pt")


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


def main() -> None:
    args = parse_args()
    run_dir = Path(args.run_dir or f"runs/{args.env.replace('/', '-')}-{args.seed}")
    store_dir = run_dir / "store"
    atari = is_atari(args.env)
    frame_stack = 4 if atari else 1

    # SIGINT/SIGTERM only raise a flag, read between steps: an interrupt landing inside
    # `store.add` would leave a half-recorded step for the final checkpoint to commit.
    stop_signal: list[int] = []

    def request_stop(signum: int, _frame: object) -> None:
        stop_signal.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C is hard

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)

    envs = gym.vector.SyncVectorEnv([lambda: make_env(args.env) for _ in range(args.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    if not isinstance(envs.single_action_space, gym.spaces.Discrete):
        raise SystemExit(f"DQN needs discrete actions; {args.env} has {envs.single_action_space}")
    obs_space = envs.single_observation_space
    obs_shape: tuple[int, ...] = obs_space.shape or ()
    num_actions = int(envs.single_action_space.n)

    torch.manual_seed(args.seed)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    q_network = QNetwork((frame_stack, *obs_shape), num_actions)
    target_network = QNetwork((frame_stack, *obs_shape), num_actions)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network.load_state_dict(q_network.state_dict())
    episodes: dict[str, list[Any]] = {"step": [], "return": [], "length": []}
    global_step, saved_at = 0, -1

    if args.resume:
        store = ReplayStore.open(store_dir)
        spec = store.spec
        want = (args.num_envs, frame_stack, args.n_step, args.gamma,
                "prioritized" if args.prioritized else "uniform")
        have = (spec.num_envs, spec.frame_stack, spec.n_step, spec.gamma, spec.sampler)
        if have != want:
            raise SystemExit(f"store (num_envs, frame_stack, n_step, gamma, sampler) = {have} "
                             f"but the arguments ask for {want}")
        ckpt = load_checkpoint(run_dir, store.counts.transitions)
        q_network.load_state_dict(ckpt["q_network"])
        target_network.load_state_dict(ckpt["target_network"])
        optimizer.load_state_dict(ckpt["optimizer"])
        episodes = ckpt["episodes"]
        global_step = int(ckpt["global_step"])
        tqdm.write(f"resumed at step {global_step} with {ckpt['transitions']} transitions "
                   f"in the store")
    else:
        if run_dir.exists() and any(run_dir.iterdir()):
            if not args.overwrite:
                raise SystemExit(f"{run_dir} already holds a run: pass --resume or --overwrite")
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        store = ReplayStore.create(
            store_dir, capacity=args.buffer_size, obs_shape=obs_shape,
            obs_dtype=obs_space.dtype, num_envs=args.num_envs, frame_stack=frame_stack,
            n_step=args.n_step, gamma=args.gamma, seed=args.seed,
            sampler="prioritized" if args.prioritized else "uniform", alpha=args.alpha)

    def checkpoint() -> None:
        nonlocal saved_at
        saved_at = global_step
        save_checkpoint(run_dir, store, {
            "q_network": q_network.state_dict(), "target_network": target_network.state_dict(),
            "optimizer": optimizer.state_dict(), "global_step": global_step,
            "episodes": episodes, "args": asdict(args)})
        write_logs(run_dir, episodes, args.return_window)

    if not args.resume:
        checkpoint()  # step 0: a run directory is always resumable

    # Envs restart fresh on resume: `store.reset` ends the episodes the last checkpoint left
    # running as truncated. Seeds move with the step so a resumed run sees new episodes.
    rng = np.random.default_rng([args.seed, global_step])
    obs, _ = envs.reset(seed=args.seed + global_step)
    store.reset(for_store(obs))
    stack = np.zeros((args.num_envs, frame_stack, *obs_shape), dtype=obs_space.dtype)
    push_frames(stack, obs, np.ones(args.num_envs, dtype=bool))
    autoreset = np.zeros(args.num_envs, dtype=bool)
    ep_return = np.zeros(args.num_envs)
    ep_length = np.zeros(args.num_envs, dtype=np.int64)
    solved_at = None
    start_step, start_time = global_step, time.time()
    shown = (start_time, global_step)  # (time, step) the postfix was last shown at
    disk_at, disk_mib = 0.0, 0.0
    progress = tqdm(total=args.total_timesteps, initial=global_step, unit="step",
                    dynamic_ncols=True)

    while global_step < args.total_timesteps and not stop_signal:
        # Act: epsilon-greedy on the agent's own stack of the last `frame_stack` frames.
        epsilon = linear_schedule(args.start_e, args.end_e,
                                  args.exploration_fraction * args.total_timesteps, global_step)
        with torch.no_grad():
            greedy = q_network(torch.from_numpy(stack)).argmax(1).numpy()
        explore = rng.random(args.num_envs) < epsilon
        actions = np.where(explore, rng.integers(num_actions, size=args.num_envs), greedy)
        next_obs, rewards, terminated, truncated, _ = envs.step(actions)

        # Record: envs flagged `autoreset` ignored the action and returned o_0 of a new episode.
        stored_rewards = np.sign(rewards) if atari else rewards
        store.add(actions, stored_rewards, for_store(next_obs), terminated, truncated,
                  autoreset=autoreset)
        push_frames(stack, next_obs, autoreset)
        ep_return += np.where(autoreset, 0.0, rewards)
        ep_length += ~autoreset
        before, global_step = global_step, global_step + args.num_envs
        for i in np.flatnonzero(terminated | truncated):
            episodes["step"].append(global_step)
            episodes["return"].append(float(ep_return[i]))
            episodes["length"].append(int(ep_length[i]))
        ep_return[terminated | truncated], ep_length[terminated | truncated] = 0.0, 0
        autoreset = terminated | truncated

        # Learn: one gradient step per `train_frequency` env steps.
        if global_step > args.learning_starts:
            beta = linear_schedule(args.beta, 1.0, args.total_timesteps, global_step)
            for _ in range(crossed(before, global_step, args.train_frequency)):
                batch = store.sample(args.batch_size, beta=beta)
                with torch.no_grad():
                    next_value = target_network(batch.next_obs).max(1).values
                    td_target = batch.reward + batch.discount * next_value
                q_value = q_network(batch.obs).gather(1, batch.action.view(-1, 1)).squeeze(1)
                huber = F.smooth_l1_loss(q_value, td_target, reduction="none")
                loss = (batch.weights * huber).mean()  # weights are ones without --prioritized
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if args.prioritized:
                    store.update_priorities(batch.ids, (td_target - q_value).abs().detach().numpy())
            if crossed(before, global_step, args.target_network_frequency):
                target_network.load_state_dict(q_network.state_dict())

        recent = mean_recent(episodes, args.return_window)
        if solved_at is None and len(episodes["return"]) >= args.return_window \
                and recent >= args.stop_at_return:
            solved_at = global_step
        if crossed(before, global_step, args.checkpoint_every):
            checkpoint()
        progress.update(global_step - before)
        now = time.time()
        if now - shown[0] >= args.progress_every:  # truthful from step 0
            if now - disk_at >= 10.0:  # scanning a big store's files takes a while
                disk_at, disk_mib = now, dir_bytes(store_dir) / 2**20
            progress.set_postfix(
                episodes=len(episodes["return"]), ret=f"{recent:.1f}", eps=f"{epsilon:.2f}",
                sps=int((global_step - shown[1]) / max(now - shown[0], 1e-9)),
                disk=f"{disk_mib:.1f}MiB", refresh=False)
            shown = (now, global_step)
        if solved_at is not None:
            break

    progress.close()
    envs.close()
    if saved_at != global_step:
        checkpoint()
    wall = time.time() - start_time
    summary = {
        "env": args.env, "seed": args.seed, "global_step": global_step,
        "episodes": len(episodes["return"]),
        "mean_return": mean_recent(episodes, args.return_window),
        "solved_at_step": solved_at, "interrupted": bool(stop_signal),
        "wall_seconds": wall, "steps_per_second": (global_step - start_step) / max(wall, 1e-9),
        "store_bytes": dir_bytes(store_dir), "store_transitions": store.counts.transitions,
    }
    store.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    tqdm.write(f"stopped at step {global_step}: " + json.dumps(summary))


if __name__ == "__main__":
    main()
