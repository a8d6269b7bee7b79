"""`FrameOnceReplayBuffer(frames_on_device=True)`: the store keeps its frames on the buffer's
device too and `sample` gathers batches there. ``device="cpu"`` runs the same code: its
batches equal the plain buffer's of the same seed, field by field."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch
from gymnasium import spaces

pytest.importorskip("stable_baselines3", reason='pip install "mmreplay[sb3]"')

from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.vec_env import VecNormalize  # noqa: E402
from test_sb3 import CyclingEnv, add_unnormalized, drive  # noqa: E402

from mmreplay import device_frames  # noqa: E402
from mmreplay.integrations.sb3 import FrameOnceReplayBuffer  # noqa: E402

BOX = spaces.Box(0, 255, (4, 6, 5), np.uint8)  # 4 stacked frames of (1, 6, 5)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def buffer(path, device: str = "cpu", **kw) -> FrameOnceReplayBuffer:
    return FrameOnceReplayBuffer(500, BOX, spaces.Discrete(3), device=device, path=path,
                                 frame_stack=4, n_steps=3, gamma=0.9, seed=3, **kw)


def assert_same(a, b) -> None:
    for name in a._fields:
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, name
        torch.testing.assert_close(x.cpu(), y.cpu(), rtol=0, atol=0, msg=name)


def test_device_batches_equal_the_plain_buffers(tmp_path):
    plain, ours = buffer(tmp_path / "p"), buffer(tmp_path / "d", frames_on_device=True)
    drive([plain, ours], n_envs=1, frame_shape=(1, 6, 5), steps=60, seed=2)
    assert ours._frames_on_device
    for _ in range(5):
        assert_same(plain.sample(16), ours.sample(16))
    ids = ours.store.valid_ids()[::7]
    assert_same(plain.get(ids), ours.get(ids))
    plain.close()
    ours.close()


def test_pickling_keeps_the_option_and_reopens_on_the_device(tmp_path):
    ours = buffer(tmp_path / "d", frames_on_device=True)
    drive([ours], n_envs=1, frame_shape=(1, 6, 5), steps=30, seed=1)
    data = pickle.dumps(ours)
    ours.close()
    back = pickle.loads(data)
    assert back._config["frames_on_device"] and back._frames_on_device
    assert back.sample(8).observations.shape == (8, 4, 6, 5)
    back.close()


def test_a_store_too_big_for_the_device_falls_back_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(device_frames, "free_bytes", lambda device: 1000)
    plain = buffer(tmp_path / "p")
    with pytest.warns(UserWarning, match="frames_on_device=True.*need .* bytes.*on the host"):
        ours = buffer(tmp_path / "d", frames_on_device=True, stack_padding="zero")
    assert not ours._frames_on_device and ours._config["frames_on_device"]
    drive([plain, ours], n_envs=1, frame_shape=(1, 6, 5), steps=30, seed=5)
    assert_same(plain.sample(8), ours.sample(8))
    plain.close()
    ours.close()


def test_vecnormalize_samples_come_back_from_the_device(tmp_path):
    env = VecNormalize(make_vec_env(CyclingEnv))
    ours = FrameOnceReplayBuffer(100, env.observation_space, env.action_space, device="cpu",
                                 path=tmp_path / "s", frames_on_device=True)
    add_unnormalized(ours, env, 60)
    sample = ours.sample(40, env)
    assert torch.allclose(sample.observations.mean(0), torch.zeros(1), atol=1)
    assert ours.sample(8).observations.min() >= 1  # unnormalized without env
    ours.close()


def test_the_option_is_a_bool(tmp_path):
    with pytest.raises(ValueError, match="frames_on_device must be True or False, got 'yes'"):
        buffer(tmp_path / "d", frames_on_device="yes")


@CUDA
def test_cuda_samples_are_gathered_on_the_device(tmp_path):
    plain, ours = buffer(tmp_path / "p"), buffer(tmp_path / "d", "cuda", frames_on_device=True)
    drive([plain, ours], n_envs=1, frame_shape=(1, 6, 5), steps=60, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ours.sample(16)
    assert got.observations.is_cuda and got.discounts.is_cuda
    assert_same(plain.sample(16), got)
    ours.close()
    plain.close()


@CUDA
@pytest.mark.parametrize("channels", ["first", "last"])
def test_cuda_samples_equal_the_cpu_buffers_in_either_channel_order(tmp_path, channels):
    """A buffer on CUDA (frames on the host, batches page-locked and copied) hands out the
    samples the same buffer on the CPU does for the same seed; channels last, the stacks'
    channels are moved on the device after the copy."""
    box = BOX if channels == "first" else spaces.Box(0, 255, (6, 5, 4), np.uint8)
    frame = (1, 6, 5) if channels == "first" else (6, 5, 1)
    pair = [FrameOnceReplayBuffer(500, box, spaces.Discrete(3), device=device,
                                  path=tmp_path / device, frame_stack=4, n_steps=3, gamma=0.9,
                                  seed=3, channels_order=channels) for device in ("cpu", "cuda")]
    drive(pair, n_envs=1, frame_shape=frame, steps=60, seed=2, channels_order=channels)
    for _ in range(5):
        got = pair[1].sample(16)
        assert got.observations.is_cuda and got.next_observations.is_cuda
        assert_same(pair[0].sample(16), got)
    for buf in pair:
        buf.close()
