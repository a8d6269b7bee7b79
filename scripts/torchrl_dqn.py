"""TorchRL's Atari DQN (pytorch/rl ``sota-implementations/dqn/dqn_atari.py``) with the
replay buffer swapped for mmreplay's frame-once storage.

    python scripts/torchrl_dqn.py --total-frames 20000 --learning-starts 5000
    python scripts/torchrl_dqn.py ... --resume     # continue from run_dir/rb (its checkpoint)
    python scripts/torchrl_dqn.py ... --overwrite  # start again in the same run_dir

Everything else is TorchRL's: a `Collector` over a `GymWrapper` Atari env with `CatFrames`
(4 stacks of 84x84 frames, padded by repeating the first frame), a `QValueActor` (the Nature
CNN), `EGreedyModule`, `DQNLoss` and `HardUpdate`. The one change, against TorchRL's::

    replay_buffer = TensorDictReplayBuffer(storage=LazyMemmapStorage(buffer_size),
                                           batch_size=batch_size, prefetch=3)
    replay_buffer = make_replay_buffer(run_dir / "rb", buffer_size,
                                       batch_size=batch_size, prefetch=3, frame_stack=4)

TorchRL's own script resizes with torchvision (``Resize``) and normalizes pixels to floats
(``ToTensorImage``, ``VecNorm``); here gymnasium's `AtariPreprocessing` gives uint8 84x84
frames and the network divides by 255, so the buffer holds uint8 frames, each once.
Prints one JSON line at the end (steps, updates, returns, what the store holds, disk).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import ale_py
import gymnasium as gym
import numpy as np
import torch
import tyro
from common import dir_bytes, prepare_run_dir, run_main
from tensordict.nn import TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import Composite
from torchrl.envs import (
    CatFrames,
    GymWrapper,
    RenameTransform,
    RewardSum,
    SignTransform,
    StepCounter,
    TransformedEnv,
    UnsqueezeTransform,
)
from torchrl.modules import MLP, ConvNet, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, HardUpdate

from mmreplay.integrations.torchrl import make_replay_buffer


@dataclass
class Args:
    env_id: str = "ALE/Pong-v5"
    """gymnasium Atari id"""
    seed: int = 0
    """seed of torch, the env and the store's sampler"""
    total_frames: int = 20_000
    """agent steps to collect (each 4 emulator frames)"""
    frames_per_batch: int = 400
    """agent steps per collector batch (TorchRL's config: 1600 frames / frame_skip 4)"""
    learning_starts: int = 5_000
    """agent steps collected before the first gradient step"""
    num_updates: int = 100
    """gradient steps per collector batch once learning started"""
    buffer_size: int = 100_000
    """replay capacity in frames (the store keeps each once)"""
    batch_size: int = 32
    """transitions per gradient step"""
    prefetch: int = 3
    """batches TorchRL's replay buffer samples ahead in threads"""
    lr: float = 2.5e-4
    """Adam learning rate"""
    gamma: float = 0.99
    """discount"""
    eps_start: float = 1.0
    """initial exploration rate"""
    eps_end: float = 0.01
    """final exploration rate"""
    annealing_frames: int = 250_000
    """agent steps over which epsilon decays"""
    hard_update_freq: int = 2_500
    """gradient steps between target network copies"""
    max_grad_norm: float = 10.0
    """gradient clipping"""
    run_dir: str = "runs/torchrl_dqn"
    """holds the replay store (run_dir/rb) and its checkpoint (run_dir/rb_ckpt)"""
    resume: bool = False
    """reopen run_dir/rb and load run_dir/rb_ckpt instead of starting empty"""
    overwrite: bool = False
    """delete `run_dir` first if it already holds a run (without `--resume`)"""


class Scale(torch.nn.Module):
    """uint8 pixels -> floats in [0, 1] (TorchRL's script normalizes in the env instead)."""

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels.float() / 255.0


def make_env(env_id: str, seed: int) -> TransformedEnv:
    gym.register_envs(ale_py)
    atari = gym.make(env_id, frameskip=1, repeat_action_probability=0.0)
    atari = gym.wrappers.AtariPreprocessing(atari, noop_max=30, frame_skip=4, screen_size=84,
                                            grayscale_obs=True)
    env = TransformedEnv(GymWrapper(atari, categorical_action_encoding=True))
    env.append_transform(RenameTransform(in_keys=["observation"], out_keys=["pixels"]))
    env.append_transform(UnsqueezeTransform(-3, in_keys=["pixels"]))
    env.append_transform(CatFrames(N=4, dim=-3, in_keys=["pixels"]))
    env.append_transform(SignTransform(in_keys=["reward"]))
    env.append_transform(RewardSum())
    env.append_transform(StepCounter(max_steps=4500))
    env.set_seed(seed)
    return env


def make_model(env: TransformedEnv) -> QValueActor:
    action_spec = env.full_action_spec["action"]
    cnn = ConvNet(activation_class=torch.nn.ReLU, num_cells=[32, 64, 64],
                  kernel_sizes=[8, 4, 3], strides=[4, 2, 1])
    features = cnn(torch.ones(env.observation_spec["pixels"].shape)).shape[-1]
    mlp = MLP(in_features=features, activation_class=torch.nn.ReLU,
              out_features=action_spec.space.n, num_cells=[512])
    return QValueActor(module=torch.nn.Sequential(Scale(), cnn, mlp),
                       spec=Composite(action=action_spec), in_keys=["pixels"])


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    torch.manual_seed(args.seed)
    run_dir = prepare_run_dir(Path(args.run_dir), resume=args.resume, overwrite=args.overwrite)
    model = make_model(make_env(args.env_id, args.seed))
    greedy = EGreedyModule(annealing_num_steps=args.annealing_frames, eps_init=args.eps_start,
                           eps_end=args.eps_end, spec=model.spec)
    collector = Collector(create_env_fn=lambda: make_env(args.env_id, args.seed),
                          policy=TensorDictSequential(model, greedy),
                          frames_per_batch=args.frames_per_batch,
                          total_frames=args.total_frames,
                          init_random_frames=args.learning_starts,
                          auto_register_policy_transforms=True)
    replay_buffer = make_replay_buffer(run_dir / "rb", args.buffer_size,
                                       batch_size=args.batch_size, prefetch=args.prefetch,
                                       frame_stack=4, seed=args.seed)
    if args.resume:
        replay_buffer.loads(run_dir / "rb_ckpt")
    loss_module = DQNLoss(value_network=model, loss_function="l2", delay_value=True)
    loss_module.make_value_estimator(gamma=args.gamma)
    target_updater = HardUpdate(loss_module, value_network_update_interval=args.hard_update_freq)
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=args.lr)

    collected, updates, losses, returns, start = 0, 0, [], [], time.time()
    for data in collector:
        data = data.reshape(-1)
        collected += data.numel()
        greedy.step(data.numel())
        replay_buffer.extend(data)
        returns += data["next", "episode_reward"][data["next", "done"]].tolist()
        if collected < args.learning_starts:
            continue
        for _ in range(args.num_updates):
            loss = loss_module(replay_buffer.sample())["loss"]
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(loss_module.parameters(), args.max_grad_norm)
            optimizer.step()
            target_updater.step()
            losses.append(loss.item())
            updates += 1
        collector.update_policy_weights_()
    collector.shutdown()

    replay_buffer.dumps(run_dir / "rb_ckpt")  # flushes the store: the store is the checkpoint
    counts = replay_buffer.storage.store.counts
    print(json.dumps({
        "steps": collected, "updates": updates, "seconds": round(time.time() - start, 1),
        "mean_loss": float(np.mean(losses)) if losses else None, "episodes": len(returns),
        "mean_return": float(np.mean(returns)) if returns else None,
        "transitions": counts.transitions, "frames_written": counts.frames_written,
        "store_bytes": dir_bytes(run_dir / "rb")}))
    replay_buffer.storage.close()


if __name__ == "__main__":
    run_main(main)
