"""Stable-Baselines3 DQN / QR-DQN with mmreplay's `FrameOnceReplayBuffer` or SB3's own buffer.

    python scripts/sb3_dqn.py --env-id CartPole-v1 --buffer mmreplay --seed 1
    python scripts/sb3_dqn.py --env-id CartPole-v1 --buffer sb3 --algo qrdqn --seed 1
    python scripts/sb3_dqn.py --env-id BreakoutNoFrameskip-v4 --buffer-size 1000000 \\
        --total-timesteps 50000 --checkpoint-every 10000
    python scripts/sb3_dqn.py ... --resume          # continue from the newest checkpoint

Hyperparameters default to rl-baselines3-zoo's (``hyperparams/dqn.yml`` and ``qrdqn.yml``:
CartPole-v1, and the Atari entry for NoFrameskip games); any flag overrides them. Atari
envs are ``make_atari_env`` + ``VecFrameStack(n_stack=4)``. At the end the script
evaluates the policy and writes one JSON line of figures (return, steps/s, peak RSS,
buffer size) to ``<run-dir>/result.json`` and stdout.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tyro
from common import UsageError, on_interrupt, prepare_run_dir, resume_command, run_main


@dataclass
class Args:
    env_id: str = "CartPole-v1"
    """gymnasium id; ids with "NoFrameskip" are Atari (CnnPolicy, 4 stacked frames)"""
    algo: str = "dqn"
    """dqn (stable-baselines3) or qrdqn (sb3-contrib)"""
    buffer: str = "mmreplay"
    """mmreplay: FrameOnceReplayBuffer on disk; sb3: SB3's default ReplayBuffer"""
    seed: int = 0
    """seed of the algorithm, the envs and the store's sampler"""
    total_timesteps: int | None = None
    """env steps (default: zoo's n_timesteps for CartPole, 10M for Atari)"""
    buffer_size: int | None = None
    """replay capacity in transitions (default: zoo's)"""
    learning_starts: int | None = None
    """steps before learning starts (default: zoo's)"""
    n_envs: int = 1
    """parallel envs"""
    n_steps: int = 1
    """n-step returns"""
    run_dir: str = "runs/sb3"
    """holds the store, checkpoints and result.json"""
    checkpoint_every: int = 0
    """a checkpoint (model, then replay buffer) every this many steps; 0: none"""
    resume: bool = False
    """continue from the newest checkpoint in run_dir/checkpoints"""
    overwrite: bool = False
    """delete `run_dir` first if it already holds a run (without `--resume`)"""
    eval_episodes: int = 10
    """deterministic evaluation episodes at the end (0: skip)"""
    device: str = "cpu"
    """torch device"""


ZOO: dict[str, dict[str, Any]] = {
    "CartPole-v1": dict(n_timesteps=50_000, policy="MlpPolicy", learning_rate=2.3e-3,
                        batch_size=64, buffer_size=100_000, learning_starts=1000, gamma=0.99,
                        target_update_interval=10, train_freq=256, gradient_steps=128,
                        exploration_fraction=0.16, exploration_final_eps=0.04,
                        policy_kwargs=dict(net_arch=[256, 256])),
    "atari": dict(n_timesteps=10_000_000, policy="CnnPolicy", buffer_size=100_000,
                  learning_rate=1e-4, batch_size=32, learning_starts=100_000,
                  target_update_interval=1000, train_freq=4, gradient_steps=1,
                  exploration_fraction=0.1, exploration_final_eps=0.01,
                  optimize_memory_usage=False),
}
QRDQN_EXTRA = {"CartPole-v1": dict(n_quantiles=10), "atari": {}}


def hyperparameters(args: Args, atari: bool) -> tuple[Any, dict[str, Any], int]:
    """(algorithm class, its keyword arguments, total timesteps): zoo's, overridden by flags."""
    from stable_baselines3 import DQN

    hp = dict(ZOO["atari" if atari else args.env_id])
    total = args.total_timesteps or hp.pop("n_timesteps")
    hp.pop("n_timesteps", None)
    for name in ("buffer_size", "learning_starts"):
        if getattr(args, name) is not None:
            hp[name] = getattr(args, name)
    hp["n_steps"] = args.n_steps
    if args.algo == "dqn":
        return DQN, hp, total
    from sb3_contrib import QRDQN

    hp["policy_kwargs"] = {**hp.get("policy_kwargs", {}),
                           **QRDQN_EXTRA["atari" if atari else args.env_id]}
    return QRDQN, hp, total


def make_vec_envs(args: Args, atari: bool) -> Any:
    """`n_envs` envs: Atari through `make_atari_env` + 4 stacked frames, others as they are."""
    from stable_baselines3.common.env_util import make_atari_env, make_vec_env
    from stable_baselines3.common.vec_env import VecFrameStack

    if not atari:
        return make_vec_env(args.env_id, n_envs=args.n_envs, seed=args.seed)
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    return VecFrameStack(make_atari_env(args.env_id, n_envs=args.n_envs, seed=args.seed),
                         n_stack=4)


def build_model(args: Args, run: Path, atari: bool) -> tuple[Any, int, int]:
    """(the model, new or resumed, the steps it has done, the steps to reach)."""
    from mmreplay.integrations.sb3 import FrameOnceReplayBuffer

    algo_cls, hp, total = hyperparameters(args, atari)
    if args.buffer == "mmreplay":
        hp["replay_buffer_class"] = FrameOnceReplayBuffer
        hp["replay_buffer_kwargs"] = dict(path=str(run / "store"), frame_stack=4 if atari else 1)
    env = make_vec_envs(args, atari)
    if args.resume:
        model, done_steps = resume(algo_cls, run / "checkpoints", env, args.device)
    else:
        model = algo_cls(hp.pop("policy"), env, seed=args.seed, device=args.device, **hp)
        done_steps = 0
    if isinstance(model.replay_buffer, FrameOnceReplayBuffer):
        hint = (f"to continue from the last checkpoint: {resume_command(run)}"
                if args.checkpoint_every else "no checkpoint was asked for (--checkpoint-every)")
        on_interrupt(model.replay_buffer.close, message=hint)
    return model, done_steps, total


def report(args: Args, model: Any, done_steps: int, wall: float) -> dict[str, Any]:
    """The run's figures, evaluated with `eval_episodes` deterministic episodes."""
    from stable_baselines3.common.evaluation import evaluate_policy

    result = dict(
        env_id=args.env_id, algo=args.algo, buffer=args.buffer, seed=args.seed,
        n_envs=args.n_envs, n_steps=args.n_steps, buffer_size=int(model.buffer_size),
        timesteps=int(model.num_timesteps), resumed_from=done_steps,
        steps_per_second=round((model.num_timesteps - done_steps) / wall, 1),
        peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        train_return_last_100=_mean([e["r"] for e in model.ep_info_buffer]),
        buffer_transitions=int(model.replay_buffer.size()))
    if args.eval_episodes:
        mean, std = evaluate_policy(model, model.get_env(), n_eval_episodes=args.eval_episodes)
        result.update(eval_return=round(float(mean), 2), eval_return_std=round(float(std), 2))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = tyro.cli(Args, args=argv, description=__doc__)
    if args.algo not in ("dqn", "qrdqn") or args.buffer not in ("mmreplay", "sb3"):
        raise UsageError(f"--algo must be dqn or qrdqn and --buffer mmreplay or sb3, "
                         f"not {args.algo!r} and {args.buffer!r}")
    from mmreplay.integrations.sb3 import FrameOnceReplayBuffer

    run = prepare_run_dir(Path(args.run_dir), resume=args.resume, overwrite=args.overwrite)
    model, done_steps, total = build_model(args, run, "NoFrameskip" in args.env_id)
    callbacks = []
    if args.checkpoint_every:
        callbacks.append(checkpoints(max(args.checkpoint_every // args.n_envs, 1),
                                     run / "checkpoints"))
    start = time.perf_counter()
    model.learn(total - done_steps, callback=callbacks, reset_num_timesteps=not args.resume)
    result = report(args, model, done_steps, time.perf_counter() - start)
    if isinstance(model.replay_buffer, FrameOnceReplayBuffer):
        model.replay_buffer.close()
    (run / "result.json").write_text(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)
    return result


def checkpoints(every: int, path: Path) -> Any:
    """SB3's CheckpointCallback (model, then replay buffer, every `every` calls), except that
    a replay buffer file appears whole or not at all: written under a temporary name, then
    renamed. A run killed while writing one leaves no truncated file for `resume` to take."""
    from stable_baselines3.common.callbacks import CheckpointCallback

    class AtomicCheckpoints(CheckpointCallback):
        def _on_step(self) -> bool:
            if self.n_calls % self.save_freq == 0:
                self.model.save(self._checkpoint_path(extension="zip"))
                final = Path(self._checkpoint_path("replay_buffer_", extension="pkl"))
                partial = final.with_suffix(".pkl.partial")
                self.model.save_replay_buffer(partial)
                os.replace(partial, final)
            return True

    return AtomicCheckpoints(every, str(path))


def resume(algo_cls: Any, checkpoints: Path, env: Any, device: str) -> tuple[Any, int]:
    """The newest checkpoint that has both a model and a replay buffer, and its step count.

    `checkpoints` writes the model, then the buffer (renamed whole into place): a run killed
    between the two leaves a model without a buffer, which is skipped.
    """
    steps = sorted(int(p.stem.split("_")[2]) for p in checkpoints.glob("rl_model_*_steps.zip"))
    steps = [s for s in steps if (checkpoints / f"rl_model_replay_buffer_{s}_steps.pkl").exists()]
    if not steps:
        raise UsageError(f"no checkpoint with a replay buffer in {checkpoints}")
    model = algo_cls.load(checkpoints / f"rl_model_{steps[-1]}_steps.zip", env=env, device=device)
    model.load_replay_buffer(checkpoints / f"rl_model_replay_buffer_{steps[-1]}_steps.pkl")
    steps = steps[-1:]
    print(json.dumps(dict(resumed_at=steps[0], buffer_transitions=model.replay_buffer.size())),
          flush=True)
    return model, steps[0]


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 2) if values else None


if __name__ == "__main__":
    run_main(main)
