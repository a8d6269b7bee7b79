"""Offline DQN or CQL from a `ReplayStore` (no env while learning), evaluated in the env.

    mmreplay import-dopamine dqn_replay/Breakout/1/replay_logs runs/breakout_ckpt --checkpoints 50
    python scripts/train_offline.py --store runs/breakout_ckpt --env ALE/Breakout-v5 --algo cql

    python scripts/record_atari.py ...  # or any store: RecordToStore, import-minari, ...
    python scripts/train_offline.py --store runs/cartpole --env CartPole-v1 --eval-every 2000

The learner only samples the store (`store.sample`, n-step returns and stacks as the store
defines them): ``target = reward + discount * max_a Q_target(next_obs, a)`` with a Huber loss,
and with ``--algo cql`` the conservative term of CQL(H) for discrete actions,
``cql_alpha * (logsumexp_a Q(obs, a) - Q(obs, a_data))``, which keeps Q low on actions the
data never took. Every `eval_every` gradient steps the greedy policy (epsilon `eval_epsilon`)
plays `eval_episodes` episodes in the env, stacking its last `frame_stack` frames with zero
padding at an episode's start exactly as the store stacks them. ALE games use the usual DQN
preprocessing (84x84 grayscale, frame skip 4), the one ``import-dopamine`` data and
``record_atari.py`` use. Writes ``evals.csv`` and ``summary.json`` in `run_dir`.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
import tyro
from common import (
    QNetwork,
    UsageError,
    make_env,
    on_interrupt,
    prepare_run_dir,
    run_main,
)

from mmreplay import ReplayStore

gym.register_envs(ale_py)


@dataclass
class Args:
    store: str = ""
    """store to learn from (opened read-only)"""
    env: str = "ALE/Breakout-v5"
    """gymnasium id used for evaluation and for the number of actions"""
    algo: str = "cql"
    """`dqn` (plain offline DQN) or `cql` (DQN + the CQL(H) conservative term)"""
    cql_alpha: float = 1.0
    """weight of the conservative term (with `--algo cql`)"""
    total_steps: int = 10_000
    """gradient steps"""
    batch_size: int = 32
    """transitions per gradient step"""
    learning_rate: float = 5e-5
    """Adam learning rate"""
    target_network_frequency: int = 2000
    """gradient steps between copies of the online network into the target network"""
    eval_every: int = 5000
    """gradient steps between evaluations (and one at the end)"""
    eval_episodes: int = 5
    """episodes per evaluation"""
    eval_epsilon: float = 0.05
    """epsilon of the evaluation policy (Nature DQN's; a greedy Breakout policy that never
    presses FIRE would play until `eval_max_steps`)"""
    eval_max_steps: int = 27_000
    """step limit of an evaluation episode"""
    seed: int = 0
    """seed of the network init, the sampler and the evaluation envs"""
    torch_threads: int = 1
    """torch intra-op threads (0: torch's default)"""
    device: str = "auto"
    """torch device for the networks: `auto` (cuda when available), `cpu`, `cuda`"""
    run_dir: str = "runs/offline"
    """where evals.csv and summary.json go"""
    overwrite: bool = False
    """delete `run_dir` first if it already holds a run"""


def evaluate(q: torch.nn.Module, args: Args, frame_stack: int, pad_with_first: bool,
             rng: np.random.Generator, seed: int, device: torch.device) -> list[float]:
    """Returns of `eval_episodes` episodes of the epsilon-greedy policy."""
    env = make_env(args.env)
    returns = []
    for episode in range(args.eval_episodes):
        obs, _ = env.reset(seed=seed + episode)
        stack = np.zeros((frame_stack, *np.shape(obs)), dtype=np.asarray(obs).dtype)
        if pad_with_first:  # the store's stack_padding: "first" repeats o_0, "zero" pads
            stack[:] = obs
        else:
            stack[-1] = obs
        total, done, steps = 0.0, False, 0
        while not done and steps < args.eval_max_steps:
            if rng.random() < args.eval_epsilon:
                action = int(env.action_space.sample())
            else:
                with torch.no_grad():
                    state = torch.from_numpy(stack[None]).to(device)
                    action = int(q(state).argmax(1).item())
            obs, reward, terminated, truncated, _ = env.step(action)
            stack[:-1], stack[-1] = stack[1:].copy(), obs
            total += float(reward)
            done, steps = terminated or truncated, steps + 1
        returns.append(total)
    env.close()
    return returns


def check(args: Args) -> None:
    if not args.store or args.algo not in ("dqn", "cql"):
        raise UsageError(f"--store is required and --algo must be dqn or cql "
                         f"(got --store {args.store!r} --algo {args.algo!r})")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class Learner:
    """Online and target networks, their optimizer, and the offline DQN / CQL(H) loss."""

    q: QNetwork
    target: QNetwork
    optimizer: torch.optim.Optimizer
    device: torch.device
    num_actions: int

    def update(self, batch: Any, args: Args, step: int) -> tuple[float, float]:
        """One gradient step; (loss, conservative gap) of this batch."""
        obs, next_obs = batch.obs.to(self.device), batch.next_obs.to(self.device)
        action = batch.action.long().to(self.device)
        q_all = self.q(obs)
        q_taken = q_all.gather(1, action[:, None]).squeeze(1)
        with torch.no_grad():
            bootstrap = self.target(next_obs).max(1).values
            td_target = (batch.reward.to(self.device)
                         + batch.discount.to(self.device) * bootstrap)
        loss = F.smooth_l1_loss(q_taken, td_target)
        conservative = (torch.logsumexp(q_all, 1) - q_taken).mean()
        if args.algo == "cql":
            loss = loss + args.cql_alpha * conservative
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if step % args.target_network_frequency == 0:
            self.target.load_state_dict(self.q.state_dict())
        return float(loss.item()), float(conservative.item())


def make_learner(args: Args, state_shape: tuple[int, ...]) -> Learner:
    num_actions = int(make_env(args.env).action_space.n)
    device = pick_device(args.device)
    q = QNetwork(state_shape, num_actions, hidden=(256, 256)).to(device)
    target = QNetwork(state_shape, num_actions, hidden=(256, 256)).to(device)
    target.load_state_dict(q.state_dict())
    optimizer = torch.optim.Adam(q.parameters(), lr=args.learning_rate, eps=0.01 / 32)
    return Learner(q, target, optimizer, device, num_actions)


def write_results(run_dir: Path, args: Args, evals: list[dict[str, float]],
                  seconds: float) -> None:
    with open(run_dir / "evals.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(evals[0]))
        writer.writeheader()
        writer.writerows(evals)
    summary = {"args": asdict(args), "evals": evals,
               "steps_per_second": round(args.total_steps / seconds, 1)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    check(args)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    store = ReplayStore.open(args.store, mode="r")
    run_dir = prepare_run_dir(Path(args.run_dir), overwrite=args.overwrite, resumable=False)
    spec = store.spec
    state_shape = (spec.frame_stack, *spec.obs_shape)
    learner = make_learner(args, state_shape)
    print(f"{len(store)} sampleable transitions, states {state_shape}, "
          f"{learner.num_actions} actions, {args.algo} on {learner.device}")
    evals: list[dict[str, float]] = []
    batches = store.batches(args.batch_size, prefetch=2)
    on_interrupt(batches.close)
    start = time.perf_counter()
    for step in range(1, args.total_steps + 1):
        loss, gap = learner.update(next(batches), args, step)
        if step % args.eval_every == 0 or step == args.total_steps:
            returns = evaluate(learner.q, args, spec.frame_stack, spec.stack_padding == "first",
                               rng, seed=args.seed + 1000 * step, device=learner.device)
            row = {"step": step, "mean_return": float(np.mean(returns)),
                   "min_return": float(np.min(returns)), "max_return": float(np.max(returns)),
                   "loss": loss, "conservative_gap": gap,
                   "seconds": round(time.perf_counter() - start, 1)}
            evals.append(row)
            print(json.dumps(row))
    batches.close()
    store.close()
    write_results(run_dir, args, evals, time.perf_counter() - start)
    print(f"done: {args.total_steps} steps, last mean return {evals[-1]['mean_return']:.2f}")


if __name__ == "__main__":
    run_main(main)
