"""Ape-X DQN on Ray: N env actors feed one store actor, a learner samples with PER and n-step.

    python scripts/apex_dqn.py                          # Breakout, 4 actors, local cluster
    python scripts/apex_dqn.py --env CartPole-v1 --num-actors 2 --total-timesteps 20000 \\
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

``--store s3://bucket/prefix`` mirrors the run there: the store actor mirrors every flush it
makes (scheduled or timed) to ``PREFIX/store`` in the background, holding the prefix's writer
lease; a checkpoint waits until its flush is in the bucket, then uploads the checkpoint beside
it. ``--resume --store URL`` with an empty run directory (a machine that never saw the run)
brings both down first (docs/object-storage.md).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ale_py
import common
import gymnasium as gym
import numpy as np
import ray
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

from mmreplay.errors import RateLimitTimeoutError
from mmreplay.integrations.ray import BlockWriter, RemoteBatches, start_store_actor
from mmreplay.rate_limit import RateLimiter

gym.register_envs(ale_py)


@dataclass
class Args(StoreArgs):
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


def apex_epsilon(i: int, n: int) -> float:
    """Ape-X's per-actor exploration: 0.4 ** (1 + 7 i / (N - 1))."""
    return 0.4 ** (1 + 7 * i / max(n - 1, 1))


class EnvActor:
    """Steps a vector env with a fixed epsilon and writes every step through a BlockWriter."""

    def __init__(self, args: Args, index: int, store: Any, env_ids: list[int],
                 start_step: int = 0) -> None:
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
        # seeded by the run's seed, the actor and the step it starts at (a resumed run
        # explores on from there instead of repeating its first steps)
        self.rng = np.random.default_rng([args.seed, index, start_step])
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


def save_checkpoint(run_dir: Path, store: Any, state: dict[str, Any],
                    bucket: RunBucket | None = None) -> None:
    """Flush the store, then put the checkpoint in place (temp file + rename). With `bucket`
    the store actor's mirror has pushed the flush before it returns, then the checkpoint
    goes up: the bucket's store holds at least the transitions its checkpoint counted, as
    on disk."""
    flushed = ray.get(store.flush.remote(wait_mirror=bucket is not None))
    pending = run_dir / "checkpoint.pt.pending"
    torch.save({**state, "transitions": flushed.transitions}, pending)
    os.replace(pending, run_dir / "checkpoint.pt")
    if bucket is not None:
        bucket.upload(run_dir, "checkpoint.pt")


def make_rate_limiter(args: Args) -> RateLimiter | None:
    """The store's limiter for `--samples-per-insert`: a band of a few blocks or batches; a
    short timeout so that the learner goes back to dispatching actor calls."""
    spi = args.samples_per_insert
    if spi <= 0:
        return None
    buffer = max(2 * max(1.0, spi), spi * args.block_steps * args.envs_per_actor,
                 2.0 * args.batch_size)
    return RateLimiter.sample_to_insert_ratio(spi, args.learning_starts, buffer, timeout_s=0.2)


def start_ray(args: Args) -> None:
    """Connect to `--ray-address` or start a local cluster; the Ray workers import `common`
    from this process (it travels with the actors' code, not by module path)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.cloudpickle.register_pickle_by_value(common)
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False,
                 object_store_memory=(args.object_store_mb << 20) or None)


@dataclass
class Run:
    """The learner's side of a run: counters, episode log, networks, the store actor."""

    args: Args
    run_dir: Path
    learner: Learner
    store: Any = None
    global_step: int = 0
    updates: int = 0
    episodes: dict[str, list[Any]] = field(default_factory=lambda: {"step": [], "return": []})
    bucket: RunBucket | None = None  # `--store`: the run's copy in object storage

    def checkpoint(self) -> None:
        save_checkpoint(self.run_dir, self.store, {
            **self.learner.state(), "global_step": self.global_step, "updates": self.updates,
            "episodes": self.episodes, "args": asdict(self.args)}, self.bucket)

    def record(self, report: dict[str, Any]) -> int:
        """Count an actor call's steps and episodes; returns the step count before it."""
        before, self.global_step = self.global_step, self.global_step + report["steps"]
        for ret in report["returns"]:
            self.episodes["step"].append(self.global_step)
            self.episodes["return"].append(ret)
        return before

    def mean_return(self) -> float | None:
        recent = self.episodes["return"][-self.args.return_window:]
        return float(np.mean(recent)) if recent else None

    def weights(self) -> Any:
        return ray.put({k: v.clone() for k, v in self.learner.q.state_dict().items()})


def open_run(args: Args, run_dir: Path, bucket: RunBucket | None = None) -> Run:
    """A new run (store actor creating the store) or the one in `run_dir` resumed (from a
    bucket, `main` brought the store down first); with `bucket` the store actor mirrors every
    flush back there (taking the prefix's writer lease as it starts)."""
    probe = make_env(args.env)
    obs_space, num_actions = probe.observation_space, int(probe.action_space.n)
    probe.close()
    k = 4 if is_atari(args.env) else 1
    run = Run(args, run_dir, Learner.create((k, *obs_space.shape), num_actions,
                                            args.learning_rate))
    create = None
    if args.resume:
        ckpt = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
        run.learner.load(ckpt)
        run.global_step, run.updates = ckpt["global_step"], ckpt["updates"]
        run.episodes = ckpt["episodes"]
        tqdm.write(f"resumed at step {run.global_step} ({run.updates} updates, "
                   f"{ckpt['transitions']} transitions committed with the checkpoint)")
    else:
        create = dict(capacity=args.buffer_size, obs_shape=obs_space.shape,
                      obs_dtype=obs_space.dtype, num_envs=args.num_actors * args.envs_per_actor,
                      frame_stack=k, n_step=args.n_step, gamma=args.gamma, seed=args.seed,
                      sampler="prioritized", alpha=args.alpha)
    run.store = start_store_actor(run_dir / "store", create,
                                  flush_every_steps=args.flush_every_steps,
                                  rate_limiter=make_rate_limiter(args),
                                  mirror=None if bucket is None else bucket.store_url,
                                  take_over=args.take_over)
    run.bucket = bucket
    spec = ray.get(run.store.spec.remote())
    if spec.num_envs != args.num_actors * args.envs_per_actor:
        raise UsageError(f"the store has {spec.num_envs} envs; the arguments ask for "
                         f"{args.num_actors} x {args.envs_per_actor}")
    return run


class Feeder:
    """The env actors' calls in flight. Each call asks for at most what is left of
    `total_timesteps`, so a run ends where it was asked to (up to one step per env)."""

    def __init__(self, run: Run) -> None:
        args = run.args
        remote_actor = ray.remote(num_cpus=args.actor_cpus)(EnvActor)
        self.actors = [remote_actor.remote(args, i, run.store,
                                           list(range(i * args.envs_per_actor,
                                                      (i + 1) * args.envs_per_actor)),
                                           run.global_step)
                       for i in range(args.num_actors)]
        self.run, self.running = run, {}
        self.acked: dict[Any, int] = {}
        self.sent_bytes: dict[Any, int] = {}

    def submit(self, actor: Any, weights: Any) -> None:
        in_flight = sum(steps for _, steps in self.running.values())
        left = self.run.args.total_timesteps - self.run.global_step - in_flight
        steps = min(self.run.args.actor_steps, left)
        if steps > 0:
            self.running[actor.run.remote(steps, weights)] = (actor, steps)

    def collect(self, timeout: float) -> list[tuple[Any, dict[str, Any]]]:
        """The calls that finished within `timeout` seconds: (actor, report)."""
        if not self.running:
            return []
        done, _ = ray.wait(list(self.running), num_returns=1, timeout=timeout)
        out = []
        for ref in done:
            actor, _ = self.running.pop(ref)
            report = ray.get(ref)
            self.acked[actor], self.sent_bytes[actor] = report["acked"], report["bytes"]
            out.append((actor, report))
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Wait for the calls in flight (their steps are in the store: they count), then for
        every block to reach the store actor."""
        reports = [report for _, report in self.collect_all()]
        ray.get([a.drain.remote() for a in self.actors])
        return reports

    def collect_all(self) -> list[tuple[Any, dict[str, Any]]]:
        out = []
        while self.running:
            out += self.collect(timeout=60.0)
        return out

    def bytes_per_step(self) -> float:
        return sum(self.sent_bytes.values()) / max(sum(self.acked.values()), 1)


class Progress:
    """The tqdm bar; ingest and learn rates, mean return and episodes shown every second
    and once more at the end."""

    def __init__(self, run: Run) -> None:
        self.run, self.start = run, (time.time(), run.global_step, run.updates)
        self.bar = tqdm(total=run.args.total_timesteps, initial=run.global_step, unit="step",
                        dynamic_ncols=True)
        self.shown = self.start[0]

    def show(self, *, force: bool = False) -> None:
        now, run = time.time(), self.run
        if not force and now - self.shown < 1.0:
            return
        self.shown, elapsed = now, max(now - self.start[0], 1e-9)
        mean = run.mean_return()
        self.bar.set_postfix(
            ingest=f"{(run.global_step - self.start[1]) / elapsed:.0f}/s",
            learn=f"{(run.updates - self.start[2]) / elapsed:.1f}b/s",
            ret="n/a" if mean is None else f"{mean:.1f}", episodes=len(run.episodes["return"]),
            refresh=force)

    def close(self) -> None:
        self.show(force=True)
        self.bar.close()


def learn(run: Run, batches: RemoteBatches) -> None:
    """One gradient step on a prefetched batch; priorities go back without waiting. With
    a rate limiter, a learner ahead of the actors returns without a step."""
    args, learner = run.args, run.learner
    batches.beta = linear_schedule(args.beta, 1.0, args.total_timesteps, run.global_step)
    try:
        batch = next(batches)
    except RateLimitTimeoutError:
        return  # ahead of the actors: hand their finished calls back first
    batches.update_priorities(batch.ids, learner.update(batch))
    run.updates += 1
    if run.updates % args.target_network_frequency == 0:
        learner.sync_target()


def train(run: Run, feeder: Feeder, progress: Progress, stop: StopFlag) -> RemoteBatches | None:
    """Collect actor calls and learn until `total_timesteps`, a stop signal or
    `stop_at_return`; at most one gradient step per `train_frequency` env steps."""
    args = run.args
    weights = run.weights()
    for actor in feeder.actors:
        feeder.submit(actor, weights)
    batches: RemoteBatches | None = None
    while run.global_step < args.total_timesteps and not stop:
        learner_due = batches is not None and (
            args.samples_per_insert > 0 or run.updates < run.global_step / args.train_frequency)
        for actor, report in feeder.collect(timeout=0 if learner_due else 0.05):
            before = run.record(report)
            feeder.submit(actor, weights)
            progress.bar.update(run.global_step - before)
            if crossed(before, run.global_step, args.checkpoint_every):
                run.checkpoint()
        if batches is None and ray.get(run.store.counts.remote()).sampleable \
                >= args.learning_starts:
            batches = RemoteBatches(run.store, args.batch_size, prefetch=args.prefetch,
                                    beta=args.beta, compress=args.compress,
                                    background=args.samples_per_insert <= 0)
        if learner_due:
            learn(run, batches)
            if run.updates % args.weight_sync_every == 0:
                weights = run.weights()
        progress.show()
        mean = run.mean_return()
        if len(run.episodes["return"]) >= args.return_window and mean is not None \
                and mean >= args.stop_at_return:
            break
    return batches


def finish(run: Run, feeder: Feeder, progress: Progress, batches: RemoteBatches | None,
           interrupted: bool) -> dict[str, Any]:
    """Count the calls in flight, checkpoint, close the store; returns the summary."""
    limited = ray.get(run.store.rate_limiter_stats.remote())  # as the learner stops
    ray.get(run.store.set_rate_limiting.remote(False))  # the learner stops: let actors finish
    for report in feeder.finish():
        progress.bar.update(run.global_step - run.record(report))
    progress.close()
    if batches is not None:
        batches.close()
    mirrored = ray.get(run.store.mirror_info.remote())  # what the run pushed as it went
    run.checkpoint()
    counts = ray.get(run.store.counts.remote())
    start, start_step, start_updates = progress.start
    wall = time.time() - start
    waits = sorted(batches.waits) if batches is not None else []
    summary = {
        "env": run.args.env, "global_step": run.global_step, "updates": run.updates,
        "episodes": len(run.episodes["return"]), "mean_return": run.mean_return(),
        "ingest_steps_per_second": (run.global_step - start_step) / wall,
        "learner_batches_per_second": (run.updates - start_updates) / wall,
        "learner_wait_median_ms": 1e3 * waits[len(waits) // 2] if waits else None,
        "bytes_per_step": feeder.bytes_per_step(),
        "epsilons": [apex_epsilon(i, run.args.num_actors) for i in range(run.args.num_actors)],
        "store_transitions": counts.transitions, "interrupted": interrupted,
        "wall_seconds": wall, "rate_limiter": limited,
        "mirror": None if mirrored is None else asdict(mirrored),
    }
    ray.get(run.store.close.remote())  # with a mirror: pushes the last commit, frees the lease
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if run.bucket is not None:
        run.bucket.upload(run.run_dir, "summary.json")
    tqdm.write(f"stopped at step {run.global_step}: " + json.dumps(summary))
    return summary


def main() -> int:
    args = tyro.cli(Args, description=__doc__)
    run_dir, bucket = prepare_run(  # before Ray starts: a refused run dir costs nothing
        Path(args.run_dir or f"runs/apex-{args.env.replace('/', '-')}-{args.seed}"),
        resume=args.resume, overwrite=args.overwrite, store=args.store)
    if bucket is not None and args.resume:  # before Ray too: a prefix another writer holds
        bucket.pull_store(run_dir, take_over=args.take_over)  # is refused at once
    again = resume_command(run_dir, store=args.store)
    stop = StopFlag()
    on_interrupt(lambda: None, message=f"to continue from the last checkpoint: "
                                       f"{again}")  # on a second Ctrl-C
    start_ray(args)
    try:
        torch.manual_seed(args.seed)
        torch.set_num_threads(args.torch_threads)
        run = open_run(args, run_dir, bucket)
        feeder = Feeder(run)
        progress = Progress(run)
        batches = train(run, feeder, progress, stop)
        finish(run, feeder, progress, batches, bool(stop))
    finally:
        ray.shutdown()
    return stop.exit_status(again)


if __name__ == "__main__":
    run_main(main)
