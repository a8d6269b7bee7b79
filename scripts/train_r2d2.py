"""R2D2 (Kapturowski et al. 2019) with a `ReplayStore` of sequences, on a partially observable
CartPole: the agent sees the cart position and the pole angle, not their velocities, so it
must remember.

    python scripts/train_r2d2.py                                  # 200k steps, seed 0
    python scripts/train_r2d2.py --total-steps 2000 --learning-starts 500 --batch-size 4 \\
        --num-envs 2 --hidden 16                                   # smoke run
    python scripts/train_r2d2.py --env ALE/Pong-v5 --total-steps 20000 --batch-size 8 \\
        --buffer-size 50000 --learning-starts 2000                 # pixels, end to end

With an ALE game the observations are 84x84 grayscale frames (gymnasium's
``AtariPreprocessing``, frame skip 4), stored once each as uint8, and a Nature-CNN torso
embeds each frame before the LSTM (``--keep-dims`` is ignored).

One file, top to bottom: an LSTM Q-network (Linear -> LSTM -> Linear, dueling-free), a vector
of envs with next-step autoreset, and a store declaring the recurrent state as per-step
extras (``h``, ``c``: the state the actor had *before* it saw o_t, recorded with step t), so
each sampled sequence starts from the stored state. The learner samples prioritized
sequences of ``burn_in + learn + n_step`` steps within episodes on a grid of ``period``,
burns the state in over the first ``burn_in`` steps without gradients, and regresses n-step
double-Q targets over the next ``learn`` steps (masked where the episode ended); the
sequence priority is R2D2's 0.9 max + 0.1 mean of |TD| over those steps. Writes
``summary.json`` (and ``curve.csv``: step, episode return) under ``--run-dir``.
"""

from __future__ import annotations

import csv
import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from common import (
    is_atari,
    make_env,
    nature_cnn,
    on_interrupt,
    prepare_run_dir,
    run_main,
)

from mmreplay import ReplayStore

gym.register_envs(ale_py)


@dataclass
class Args:
    env: str = "CartPole-v1"
    """gymnasium id; vector observations are reduced to --keep-dims, ALE games give pixels"""
    keep_dims: str = "0,2"
    """observation entries the agent sees (CartPole: 0 cart position, 2 pole angle)"""
    seed: int = 0
    """seed of envs, network and store"""
    total_steps: int = 200_000
    """env steps, all envs together"""
    num_envs: int = 4
    """envs stepped together"""
    buffer_size: int = 100_000
    """store capacity in frames"""
    learning_starts: int = 5_000
    """env steps before the first update"""
    batch_size: int = 32
    """sequences per update"""
    burn_in: int = 8
    """steps that only warm the recurrent state"""
    learn: int = 16
    """steps whose TD errors train the network"""
    n_step: int = 3
    """n of the n-step targets"""
    period: int = 8
    """start grid: sequences start at episode positions divisible by this"""
    hidden: int = 64
    """LSTM size"""
    gamma: float = 0.99
    """discount"""
    learning_rate: float = 1e-3
    """Adam step size"""
    train_every: int = 4
    """env steps (all envs together) between updates"""
    target_every: int = 1000
    """env steps between target-network copies"""
    start_e: float = 1.0
    """initial epsilon"""
    end_e: float = 0.05
    """final epsilon"""
    exploration_steps: int = 30_000
    """env steps over which epsilon decays linearly"""
    eta: float = 0.9
    """priority mix: eta max|d| + (1 - eta) mean|d|"""
    alpha: float = 0.6
    """priority exponent of the store"""
    beta: float = 0.4
    """importance-weight exponent"""
    stop_at_return: float = 0.0
    """stop once the mean return of the last 20 episodes reaches this (0: run to the end)"""
    feed_forward: bool = False
    """ablation: an MLP in place of the LSTM (no memory), everything else the same"""
    run_dir: str = ""
    """where summary.json and curve.csv go (and the store); empty: a temp dir"""
    overwrite: bool = False
    """delete `run_dir` first if it already holds a run"""


class PixelTorso(nn.Module):
    """Nature-CNN torso for (..., 84, 84) uint8 frames -> (..., 64)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(*nature_cnn(1), nn.Linear(3136, 64))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        lead = frames.shape[:-2]
        x = frames.reshape(-1, 1, *frames.shape[-2:]).float() / 255.0
        return self.conv(x).reshape(*lead, 64)


class RecurrentQ(nn.Module):
    def __init__(self, obs_shape: tuple[int, ...], actions: int, hidden: int,
                 feed_forward: bool = False) -> None:
        super().__init__()
        pixels = len(obs_shape) == 2
        self.embed: nn.Module = PixelTorso() if pixels else nn.Linear(obs_shape[0], 64)
        self.lstm = nn.LSTM(64, hidden, batch_first=True)
        self.mlp = nn.Linear(64, hidden) if feed_forward else None
        self.head = nn.Linear(hidden, actions)

    def forward(self, obs: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """obs (B, T, *obs_shape), state ((B, H), (B, H)) -> q (B, T, A), next state."""
        x = F.relu(self.embed(obs))
        if self.mlp is not None:  # the ablation: no memory, the state passes through
            return self.head(F.relu(self.mlp(x))), state
        out, (h, c) = self.lstm(x, (state[0][None], state[1][None]))
        return self.head(out), (h[0], c[0])


def make_envs(args: Args) -> gym.vector.SyncVectorEnv:
    keep = [int(i) for i in args.keep_dims.split(",")]

    def pixels() -> gym.Env:
        return make_env(args.env)

    def one() -> gym.Env:
        env = gym.make(args.env)
        low, high = env.observation_space.low[keep], env.observation_space.high[keep]
        space = gym.spaces.Box(low, high, dtype=np.float32)
        return gym.wrappers.TransformObservation(env, lambda o: o[keep].astype(np.float32),
                                                 space)

    make = pixels if is_atari(args.env) else one
    return gym.vector.SyncVectorEnv([make for _ in range(args.num_envs)])


def td_targets(q_online: torch.Tensor, q_target: torch.Tensor, reward: torch.Tensor,
               terminated: torch.Tensor, mask: torch.Tensor, args: Args) -> torch.Tensor:
    """n-step double-Q targets for steps burn_in .. burn_in+learn-1 (B, learn).

    Step j sums rewards of real steps j .. j+m-1 (m <= n, cut where the episode ends) and
    bootstraps from Q at index j+m unless the episode terminated before it; index j+m may
    be the sequence's next_obs (appended at each row's first padded index).
    """
    start, stop = args.burn_in, args.burn_in + args.learn
    greedy = q_online.argmax(-1, keepdim=True)
    boot = q_target.gather(-1, greedy)[..., 0]  # (B, T+1)
    target = torch.zeros(reward.shape[0], args.learn)
    alive = torch.ones(reward.shape[0], args.learn)
    for i in range(args.n_step):
        idx = torch.arange(start, stop) + i
        step_real = mask[:, idx].float()
        target += alive * step_real * args.gamma ** i * reward[:, idx]
        alive = alive * step_real * (1 - terminated[:, idx].float())
        ends = (i == args.n_step - 1) | ~mask[:, idx + 1]
        target += alive * ends.float() * args.gamma ** (i + 1) * boot[:, idx + 1]
        alive = alive * (~ends).float()
    return target


def learn_step(store: ReplayStore, net: RecurrentQ, target: RecurrentQ,
               optimizer: torch.optim.Optimizer, args: Args) -> float:
    length = args.burn_in + args.learn + args.n_step
    seq = store.sample_sequences(args.batch_size, length, period=args.period, beta=args.beta)
    obs = torch.cat([seq.obs[:, :, -1], torch.zeros_like(seq.obs[:, :1, -1])], 1)
    obs[torch.arange(len(seq)), seq.mask.sum(1)] = seq.next_obs[:, -1]  # o after last step
    state = (seq.extras["h"][:, 0], seq.extras["c"][:, 0])
    with torch.no_grad():
        _, burned = net(obs[:, :args.burn_in], state)
        q_t, _ = target(obs, state)
        q_next, _ = net(obs, state)
    q, _ = net(obs[:, args.burn_in:], burned)
    q = torch.cat([q_next[:, :args.burn_in], q], 1)
    with torch.no_grad():
        y = td_targets(q_next, q_t, seq.reward, seq.terminated, seq.mask, args)
    sl = slice(args.burn_in, args.burn_in + args.learn)
    q_taken = q[:, sl].gather(-1, seq.action[:, sl, None])[..., 0]
    m = seq.mask[:, sl].float()
    td = (q_taken - y) * m
    loss = (seq.weights[:, None] * F.smooth_l1_loss(q_taken, y, reduction="none") * m).sum() \
        / m.sum().clamp(min=1)
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(net.parameters(), 10.0)
    optimizer.step()
    errors = torch.zeros(seq.ids.shape)
    errors[:, sl] = td.detach().abs()  # burn-in and look-ahead steps carry 0
    store.update_sequence_priorities(seq.ids, errors, eta=args.eta)
    return float(loss.detach())


@dataclass
class Acting:
    """The envs and what the agent carries between steps: the last observation, its
    recurrent state, which envs autoreset next, and the running episode returns."""

    envs: gym.vector.SyncVectorEnv
    obs: np.ndarray
    state: tuple[torch.Tensor, torch.Tensor]
    autoreset: np.ndarray
    running: np.ndarray
    rng: np.random.Generator
    returns: list[float] = field(default_factory=list)
    curve: list[tuple[int, float]] = field(default_factory=list)

    def step(self, net: RecurrentQ, store: ReplayStore, eps: float, step: int) -> None:
        """One epsilon-greedy step of every env, recorded with the state it acted from."""
        n, actions = len(self.running), int(self.envs.single_action_space.n)
        with torch.no_grad():
            q, new_state = net(torch.from_numpy(self.obs)[:, None], self.state)
        action = np.where(self.rng.random(n) < eps, self.rng.integers(0, actions, n),
                          q[:, 0].argmax(-1).numpy())
        next_obs, reward, term, trunc, _ = self.envs.step(action)
        store.add(action, reward.astype(np.float32), next_obs, term, trunc,
                  autoreset=self.autoreset,
                  extras={"h": self.state[0].numpy(), "c": self.state[1].numpy()})
        self.running += np.where(self.autoreset, 0.0, reward)
        for i in np.flatnonzero(~self.autoreset & (term | trunc)):
            self.returns.append(float(self.running[i]))
            self.curve.append((step, self.running[i]))
            self.running[i] = 0.0
        keep = torch.from_numpy(~self.autoreset).float()[:, None]  # next_obs is o_0: zero state
        self.state = (new_state[0] * keep, new_state[1] * keep)
        self.autoreset = term | trunc  # the next step of these envs starts a new episode
        self.obs = next_obs

    def mean_return(self) -> float:
        return float(np.mean(self.returns[-20:]))


def setup(args: Args, run_dir: Path) -> tuple[ReplayStore, RecurrentQ, RecurrentQ,
                                               torch.optim.Optimizer, Acting]:
    """The store (hidden state as per-step extras), the networks, the envs reset."""
    torch.manual_seed(args.seed)
    envs = make_envs(args)
    space, actions = envs.single_observation_space, int(envs.single_action_space.n)
    obs_shape = tuple(space.shape)
    hidden = ((args.hidden,), np.float32)
    store = ReplayStore.create(
        run_dir / "store", capacity=args.buffer_size, obs_shape=obs_shape,
        obs_dtype=space.dtype, num_envs=args.num_envs, seed=args.seed, sampler="prioritized",
        alpha=args.alpha, extras={"h": hidden, "c": hidden})
    on_interrupt(store.close, message=f"the store in {run_dir / 'store'} keeps the steps "
                                      f"recorded so far (this script does not resume)")
    net = RecurrentQ(obs_shape, actions, args.hidden, args.feed_forward)
    target = RecurrentQ(obs_shape, actions, args.hidden, args.feed_forward)
    target.load_state_dict(net.state_dict())
    optimizer = torch.optim.Adam(net.parameters(), lr=args.learning_rate)
    obs, _ = envs.reset(seed=args.seed)
    store.reset(obs)
    zeros = torch.zeros(args.num_envs, args.hidden)
    acting = Acting(envs, obs, (zeros, zeros.clone()), np.zeros(args.num_envs, bool),
                    np.zeros(args.num_envs), np.random.default_rng(args.seed))
    return store, net, target, optimizer, acting


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    run_dir = prepare_run_dir(Path(args.run_dir or tempfile.mkdtemp(prefix="r2d2_")),
                              overwrite=args.overwrite, resumable=False)
    store, net, target, optimizer, acting = setup(args, run_dir)
    began, step, losses = time.time(), 0, []
    while step < args.total_steps:
        eps = max(args.end_e, args.start_e - (args.start_e - args.end_e) * step
                  / args.exploration_steps)
        acting.step(net, store, eps, step)
        step += args.num_envs
        if step >= args.learning_starts and step % args.train_every < args.num_envs:
            losses.append(learn_step(store, net, target, optimizer, args))
        if step % args.target_every < args.num_envs:
            target.load_state_dict(net.state_dict())
        if args.stop_at_return and len(acting.returns) >= 20 \
                and acting.mean_return() >= args.stop_at_return:
            print(f"step {step}: mean return (last 20) {acting.mean_return():.1f} reached "
                  f"--stop-at-return", flush=True)
            break
        if step % 10_000 < args.num_envs and acting.returns:
            print(f"step {step}: episodes {len(acting.returns)}, mean return (last 20) "
                  f"{acting.mean_return():.1f}, eps {eps:.2f}, "
                  f"{step / (time.time() - began):.0f} steps/s", flush=True)
    summary = {"args": asdict(args), "steps": step, "episodes": len(acting.returns),
               "mean_return_last_20": acting.mean_return() if acting.returns else None,
               "updates": len(losses), "seconds": time.time() - began,
               "sampleable": len(store)}
    store.close()
    acting.envs.close()
    with open(run_dir / "curve.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([("step", "return"), *acting.curve])
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "args"}))


if __name__ == "__main__":
    run_main(main)
