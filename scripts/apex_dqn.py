"""Ape-X DQN on Ray: N env actors feed one store actor, a learner samples with PER and n-step.

    python scripts/apex_dqn.py                          # Breakout, 4 actors, local cluster
    python scripts/apex_dqn.py --env CartPole-v1 --num-actors 2 --total-timesteps 20000 \
        --learning-starts 1000 --learning-rate 1e-3 --buffer-size 20000 --batch-size 64
    ray start --head --port 6379                        # across machines: the head node holds
    python scripts/apex_dqn.py --ray-address auto       # the store on its local disk

Actor i explores with Ape-X's fixed epsilon_i = 0.4 ** (1 + 7 i / (N - 1)) and sends its steps
in blocks (`BlockWriter`) to the store actor (`StoreActor`, pinned to this node, flushing on a
schedule); the learner (this process) draws prioritized n-step batches through `RemoteBatches`
(several `sample` calls in flight), sends |TD error| back without waiting, and broadcasts its
weights to the actors every `weight_sync_every` gradient steps. New transitions enter with the
largest priority seen so far.

The run directory holds ``store/`` and ``checkpoint.pt`` (networks, optimizer, counters: tensors
and plain numbers, loaded with ``weights_only=True``). A checkpoint flushes the store, then
renames the checkpoint into place, so the store holds at least the transitions the checkpoint
counted (its scheduled flushes may add more: the replay keeps them). On ``--resume`` the store
actor reopens the store at its last flush and the env actors start fresh episodes.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import ale_py
import gymnasium as gym
import numpy as np
import ray
import torch
import torch.nn as nn
import torch.nn.functional as F
from gymnasium.wrappers import AtariPreprocessing
from tqdm import tqdm

from mmreplay.errors import RateLimitTimeoutError
from mmreplay.integrations.ray import BlockWriter, RemoteBatches, start_store_actor
from mmreplay.rate_limit import RateLimiter

gym.register_envs(ale_py)


@dataclass
class Args:
    env: str = "ALE/Breakout-v5"
    """gymnasium id: an ALE game (`ALE/<Game>-v5`) or a vector-observation env (`CartPole-v1`)"""
    seed: int = 0
    """seed of the envs, the networks and the store's sampler"""
    run_dir: str = ""
    """run directory (store, checkpoint); empty means `runs/apex-<env>-<seed>`"""
    resume: bool = False
    """continue the run in `run_dir` from its last checkpoint"""
    overwrite: bool = False
    """delete `run_dir` first if it already holds a run (without `--resume`)"""
    total_timesteps: int = 50_000
    """env steps in all (summed over actors)"""
    num_actors: int = 4
    """env actors (Ray actors), each with its own epsilon"""
    envs_per_actor: int = 1
    """envs each actor steps together (a `SyncVectorEnv`)"""
    actor_cpus: float = 0.25
    """CPUs Ray reserves per env actor (the store actor takes none)"""
    actor_steps: int = 256
    """env steps of one actor call between weight updates and progress reports"""
    buffer_size: int = 100_000
    """replay capacity in frames, split evenly over all envs"""
    learning_rate: float = 1e-4
    """Adam learning rate"""
    gamma: float = 0.99
    """discount factor"""
    n_step: int = 3
    """n-step returns"""
    batch_size: int = 32
    """transitions per gradient step"""
    alpha: float = 0.6
    """prioritization exponent"""
    beta: float = 0.4
    """initial importance-weight exponent, annealed linearly to 1"""
    learning_starts: int = 5_000
    """sampleable transitions in the store before the first gradient step"""
    train_frequency: float = 4.0
    """env steps per gradient step at most (the learner waits when it is ahead)"""
    samples_per_insert: float = 0.0
    """sampled transitions per inserted step, held by the store's rate limiter (Reverb's
    SampleToInsertRatio from `learning_starts`); 0: off (only `train_frequency` paces)"""
    target_network_frequency: int = 500
    """gradient steps between target network copies"""
    weight_sync_every: int = 50
    """gradient steps between broadcasts of the learner's weights to the actors"""
    block_steps: int = 32
    """steps per block an env actor sends to the store actor"""
    max_in_flight: int = 2
    """blocks per env actor waiting for the store actor (backpressure)"""
    compress: bool = True
    """lz4-compress frame blocks and sampled stacks (faster than raw here, too)"""
    prefetch: int = 4
    """`sample` calls the learner keeps in flight"""
    flush_every_steps: int = 20_000
    """steps between the store actor's scheduled flushes"""
    checkpoint_every: int = 10_000
    """env steps between checkpoints"""
    torch_threads: int = 1
    """torch threads of the learner and of each actor"""
    ray_address: str = ""
    """address of a running Ray cluster (`auto` after `ray start --head`); empty: a local one"""
    num_cpus: int = 2
    """CPUs of the local cluster (without `--ray-address`)"""
    object_store_mb: int = 0
    """object store of the local cluster in MiB; 0: Ray's default"""
    stop_at_return: float = float("inf")
    """stop once the mean return of the last `return_window` episodes reaches this"""
    return_window: int = 20
    """episodes in the mean return shown and compared with `stop_at_return`"""


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


def apex_epsilon(i: int, n: int) -> float:
    """Ape-X's per-actor exploration: 0.4 ** (1 + 7 i / (N - 1))."""
    return 0.4 ** (1 + 7 * i / max(n - 1, 1))


def push_frames(stack: np.ndarray, frames: np.ndarray, fresh: np.ndarray) -> None:
    """Shift each env's last-k frames and append the new one; `fresh` envs restart from zeros
    (the store pads stacks at an episode's start with zeros)."""
    stack[fresh] = 0
    stack[:, :-1] = stack[:, 1:]
    stack[:, -1] = frames


def linear_schedule(start: float, end: float, duration: float, t: int) -> float:
    slope = (end - start) / max(duration, 1.0)
    return max(slope * t + start, end) if end < start else min(slope * t + start, end)


class EnvActor:
    """Steps a vector env with a fixed epsilon and writes every step through a BlockWriter."""

    def __init__(self, args: Args, index: int, store: Any, env_ids: list[int]) -> None:
        torch.set_num_threads(args.torch_threads)
        self.args, self.epsilon = args, apex_epsilon(index, args.num_actors)
        self.atari = is_atari(args.env)
        self.envs = gym.vector.SyncVectorEnv(
            [lambda: make_env(args.env) for _ in env_ids],
            autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
        space = self.envs.single_observation_space
        k = 4 if self.atari else 1
        self.num_actions = int(self.envs.single_action_space.n)
        self.q = QNetwork((k, *space.shape), self.num_actions)
        self.rng = np.random.default_rng([args.seed, index, int(time.time())])
        self.writer = BlockWriter(store, env_ids, block_steps=args.block_steps,
                                  max_in_flight=args.max_in_flight, compress=args.compress,
                                  insert_timeout_s=600.0)  # a rate limiter waits for the learner
        obs, _ = self.envs.reset(seed=int(self.rng.integers(2**31)))
        self.writer.reset(obs)
        self.stack = np.zeros((len(env_ids), k, *space.shape), space.dtype)
        push_frames(self.stack, obs, np.ones(len(env_ids), bool))
        self.autoreset = np.zeros(len(env_ids), bool)
        self.ep_return = np.zeros(len(env_ids))

    def run(self, steps: int, weights: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """`steps` env steps (over this actor's envs); returns what it saw."""
        if weights is not None:
            self.q.load_state_dict(weights)
        n, returns = len(self.ep_return), []
        for _ in range(max(1, steps // n)):
            with torch.no_grad():
                greedy = self.q(torch.from_numpy(self.stack)).argmax(1).numpy()
            explore = self.rng.random(n) < self.epsilon
            action = np.where(explore, self.rng.integers(self.num_actions, size=n), greedy)
            obs, reward, terminated, truncated, _ = self.envs.step(action)
            stored = np.sign(reward) if self.atari else reward
            self.writer.add(action, stored, obs, terminated, truncated, self.autoreset)
            push_frames(self.stack, obs, self.autoreset)
            self.ep_return += np.where(self.autoreset, 0.0, reward)
            done = terminated | truncated
            returns += self.ep_return[done].tolist()
            self.ep_return[done] = 0.0
            self.autoreset = done
        stats = self.writer.stats
        return {"steps": max(1, steps // n) * n, "returns": returns, "epsilon": self.epsilon,
                "acked": stats.steps_acked, "bytes": stats.bytes_sent}

    def drain(self) -> None:
        self.writer.drain()


def save_checkpoint(run_dir: Path, store: Any, state: dict[str, Any]) -> None:
    """Flush the store, then put the checkpoint in place (temp file + rename)."""
    flushed = ray.get(store.flush.remote())
    pending = run_dir / "checkpoint.pt.pending"
    torch.save({**state, "transitions": flushed.transitions}, pending)
    os.replace(pending, run_dir / "checkpoint.pt")


def make_rate_limiter(args: Args) -> RateLimiter | None:
    """The store's limiter for `--samples-per-insert`: a band of a few blocks or batches; a
    short timeout so that the learner goes back to dispatching actor calls."""
    spi = args.samples_per_insert
    if spi <= 0:
        return None
    buffer = max(2 * max(1.0, spi), spi * args.block_steps * args.envs_per_actor,
                 2.0 * args.batch_size)
    return RateLimiter.sample_to_insert_ratio(spi, args.learning_starts, buffer, timeout_s=0.2)


def main() -> None:
    args = parse_args()
    run_dir = Path(args.run_dir or f"runs/apex-{args.env.replace('/', '-')}-{args.seed}")
    stop_signal: list[int] = []
    signal.signal(signal.SIGINT, lambda s, _f: stop_signal.append(s))
    signal.signal(signal.SIGTERM, lambda s, _f: stop_signal.append(s))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False,
                 object_store_memory=(args.object_store_mb << 20) or None)

    probe = make_env(args.env)
    obs_space, num_actions = probe.observation_space, int(probe.action_space.n)
    probe.close()
    atari = is_atari(args.env)
    k = 4 if atari else 1
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.torch_threads)
    q_network = QNetwork((k, *obs_space.shape), num_actions)
    target_network = QNetwork((k, *obs_space.shape), num_actions)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network.load_state_dict(q_network.state_dict())
    global_step, updates, episodes = 0, 0, {"step": [], "return": []}
    create = None
    if args.resume:
        ckpt = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
        q_network.load_state_dict(ckpt["q_network"])
        target_network.load_state_dict(ckpt["target_network"])
        optimizer.load_state_dict(ckpt["optimizer"])
        global_step, updates, episodes = ckpt["global_step"], ckpt["updates"], ckpt["episodes"]
        tqdm.write(f"resumed at step {global_step} ({updates} updates, {ckpt['transitions']} "
                   f"transitions committed with the checkpoint)")
    else:
        if run_dir.exists() and any(run_dir.iterdir()):
            if not args.overwrite:
                raise SystemExit(f"{run_dir} already holds a run: pass --resume or --overwrite")
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        num_envs = args.num_actors * args.envs_per_actor
        create = dict(capacity=args.buffer_size, obs_shape=obs_space.shape,
                      obs_dtype=obs_space.dtype, num_envs=num_envs, frame_stack=k,
                      n_step=args.n_step, gamma=args.gamma, seed=args.seed,
                      sampler="prioritized", alpha=args.alpha)
    store = start_store_actor(run_dir / "store", create, flush_every_steps=args.flush_every_steps,
                              rate_limiter=make_rate_limiter(args))
    spec = ray.get(store.spec.remote())
    if spec.num_envs != args.num_actors * args.envs_per_actor:
        raise SystemExit(f"the store has {spec.num_envs} envs; the arguments ask for "
                         f"{args.num_actors} x {args.envs_per_actor}")

    remote_actor = ray.remote(num_cpus=args.actor_cpus)(EnvActor)
    actors = [remote_actor.remote(args, i, store, list(range(i * args.envs_per_actor,
                                                             (i + 1) * args.envs_per_actor)))
              for i in range(args.num_actors)]
    weights = ray.put({k_: v.clone() for k_, v in q_network.state_dict().items()})
    running = {a.run.remote(args.actor_steps, weights): a for a in actors}
    batches: RemoteBatches | None = None
    acked, sent_bytes = {}, {}
    start, start_step, start_updates = time.time(), global_step, updates
    shown = start
    progress = tqdm(total=args.total_timesteps, initial=global_step, unit="step",
                    dynamic_ncols=True)

    def checkpoint() -> None:
        save_checkpoint(run_dir, store, {
            "q_network": q_network.state_dict(), "target_network": target_network.state_dict(),
            "optimizer": optimizer.state_dict(), "global_step": global_step, "updates": updates,
            "episodes": episodes, "args": asdict(args)})

    while global_step < args.total_timesteps and not stop_signal:
        # Collect finished actor calls and send them on with the latest weights.
        learner_due = batches is not None and (
            args.samples_per_insert > 0 or updates < global_step / args.train_frequency)
        done, _ = ray.wait(list(running), num_returns=1, timeout=0 if learner_due else 0.05)
        for ref in done:
            actor, report = running.pop(ref), ray.get(ref)
            before, global_step = global_step, global_step + report["steps"]
            for ret in report["returns"]:
                episodes["step"].append(global_step)
                episodes["return"].append(ret)
            acked[actor], sent_bytes[actor] = report["acked"], report["bytes"]
            running[actor.run.remote(args.actor_steps, weights)] = actor
            progress.update(global_step - before)
            if global_step // args.checkpoint_every > before // args.checkpoint_every:
                checkpoint()

        # Learn, at most one gradient step per `train_frequency` env steps.
        if batches is None and ray.get(store.counts.remote()).sampleable >= args.learning_starts:
            batches = RemoteBatches(store, args.batch_size, prefetch=args.prefetch,
                                    beta=args.beta, compress=args.compress,
                                    background=args.samples_per_insert <= 0)
        if learner_due:
            batches.beta = linear_schedule(args.beta, 1.0, args.total_timesteps, global_step)
            try:
                batch = next(batches)
            except RateLimitTimeoutError:
                continue  # ahead of the actors: hand their finished calls back first
            with torch.no_grad():
                next_value = target_network(batch.next_obs).max(1).values
                td_target = batch.reward + batch.discount * next_value
            q_value = q_network(batch.obs).gather(1, batch.action.view(-1, 1)).squeeze(1)
            loss = (batch.weights * F.smooth_l1_loss(q_value, td_target, reduction="none")).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            batches.update_priorities(batch.ids, (td_target - q_value).abs().detach())
            updates += 1
            if updates % args.target_network_frequency == 0:
                target_network.load_state_dict(q_network.state_dict())
            if updates % args.weight_sync_every == 0:
                weights = ray.put({k_: v.clone() for k_, v in q_network.state_dict().items()})

        now = time.time()
        elapsed = max(now - start, 1e-9)
        recent = episodes["return"][-args.return_window:]
        mean_return = float(np.mean(recent)) if recent else float("nan")
        if now - shown >= 1.0:
            shown = now
            progress.set_postfix(
                ingest=f"{(global_step - start_step) / elapsed:.0f}/s",
                learn=f"{(updates - start_updates) / elapsed:.1f}b/s",
                ret=f"{mean_return:.1f}", episodes=len(episodes["return"]), refresh=False)
        if len(recent) >= args.return_window and mean_return >= args.stop_at_return:
            break

    progress.close()
    limited = ray.get(store.rate_limiter_stats.remote())  # as the learner stops
    ray.get(store.set_rate_limiting.remote(False))  # the learner stops: let the actors finish
    ray.get([a.drain.remote() for a in actors])
    if batches is not None:
        batches.close()
    checkpoint()
    counts = ray.get(store.counts.remote())
    wall = time.time() - start
    waits = sorted(batches.waits) if batches is not None else []
    summary = {
        "env": args.env, "global_step": global_step, "updates": updates,
        "episodes": len(episodes["return"]),
        "mean_return": float(np.mean(episodes["return"][-args.return_window:]))
        if episodes["return"] else None,
        "ingest_steps_per_second": (global_step - start_step) / wall,
        "learner_batches_per_second": (updates - start_updates) / wall,
        "learner_wait_median_ms": 1e3 * waits[len(waits) // 2] if waits else None,
        "bytes_per_step": sum(sent_bytes.values()) / max(sum(acked.values()), 1),
        "epsilons": [apex_epsilon(i, args.num_actors) for i in range(args.num_actors)],
        "store_transitions": counts.transitions, "interrupted": bool(stop_signal),
        "wall_seconds": wall, "rate_limiter": limited,
    }
    ray.get(store.close.remote())
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    tqdm.write(f"stopped at step {global_step}: " + json.dumps(summary))
    ray.shutdown()


if __name__ == "__main__":
    main()
