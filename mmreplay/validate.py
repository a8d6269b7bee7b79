"""Parse the arguments of ``reset``/``add``/``get`` into checked numpy arrays.

Every function either returns arrays with a leading env (or batch) dimension or
raises `InvalidInputError` naming what was expected and what arrived. Nothing
here mutates a store, so a rejected call leaves the store unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mmreplay.errors import InvalidInputError
from mmreplay.spec import StoreSpec


def env_ids(spec: StoreSpec, ids: Any) -> np.ndarray:
    """The envs a ``reset`` or ``add`` applies to: all of them, or the listed ones (unique)."""
    if ids is None:
        return np.arange(spec.num_envs, dtype=np.int64)
    arr = np.atleast_1d(np.asarray(ids))
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidInputError(f"env_ids must be a 1-d sequence of ints, got {ids!r}")
    arr = arr.astype(np.int64)
    bad = arr[(arr < 0) | (arr >= spec.num_envs)]
    if bad.size:
        raise InvalidInputError(
            f"unknown env id {int(bad[0])}: the store has envs 0..{spec.num_envs - 1}")
    if np.unique(arr).size != arr.size:
        raise InvalidInputError(f"env_ids has duplicates: {arr.tolist()}")
    return arr


def observations(spec: StoreSpec, obs: Any, count: int, name: str = "obs") -> np.ndarray:
    arr = np.asarray(obs)
    want = (count, *spec.obs_shape)
    if spec.num_envs == 1 and count == 1 and arr.shape != want:
        # one env: unbatched, or batched with a leading 1 (a 1-env vector env)
        if arr.shape != spec.obs_shape:
            raise InvalidInputError(
                f"{name} shape {arr.shape} != store obs_shape {spec.obs_shape} "
                f"(or {want} with the env dimension)")
        arr = arr[None]
    elif arr.shape != want:
        raise InvalidInputError(f"{name} shape {arr.shape} != expected {want} "
                                f"(leading dimension = number of envs)")
    if arr.dtype != np.dtype(spec.obs_dtype):
        raise InvalidInputError(f"{name} dtype {arr.dtype} != store obs_dtype {spec.obs_dtype}")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise InvalidInputError(f"{name} contains NaN or inf")
    return arr


def per_env(spec: StoreSpec, name: str, value: Any, tail: tuple[int, ...] = (),
            count: int | None = None) -> np.ndarray:
    """A per-env argument with a leading dimension of `count` envs (default: all of them).

    With one env (`count` 1 of a 1-env store) the argument may also come unbatched.
    """
    arr = np.asarray(value)
    count = spec.num_envs if count is None else count
    want = (count, *tail)
    if spec.num_envs == 1 and count == 1 and arr.shape == tail:
        return arr[None]
    if arr.shape != want:
        single = f" or {tail}" if spec.num_envs == 1 and count == 1 else ""
        raise InvalidInputError(f"{name} shape {arr.shape} != expected {want}{single} "
                                f"(leading dimension = number of envs)")
    return arr


def actions(spec: StoreSpec, action: Any, count: int | None = None) -> np.ndarray:
    arr = per_env(spec, "action", action, spec.action_shape, count)
    want = np.dtype(spec.action_dtype)
    if not np.can_cast(arr.dtype, want, casting="same_kind") or (
            arr.dtype.kind == "f" and want.kind in "iu"):
        raise InvalidInputError(f"action dtype {arr.dtype} cannot be stored as {want}")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise InvalidInputError("action contains NaN or inf")
    if want.kind in "iu" and arr.dtype.kind in "iu" and arr.size:
        info = np.iinfo(want)
        low, high = int(arr.min()), int(arr.max())
        if low < info.min or high > info.max:
            raise InvalidInputError(f"action {low if low < info.min else high} does not fit "
                                    f"the store's action_dtype {want}")
    return arr.astype(want)


def rewards(spec: StoreSpec, reward: Any, count: int | None = None) -> np.ndarray:
    arr = per_env(spec, "reward", reward, count=count)
    if arr.dtype.kind not in "iuf" or arr.dtype == np.bool_:
        raise InvalidInputError(f"reward must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise InvalidInputError(f"reward must be finite, got {arr.tolist()}")
    return arr.astype(np.float32)


def flags(spec: StoreSpec, name: str, value: Any, count: int | None = None) -> np.ndarray:
    if value is None and name == "autoreset":
        return np.zeros(spec.num_envs if count is None else count, bool)
    arr = per_env(spec, name, value, count=count)
    if arr.dtype != np.bool_:
        raise InvalidInputError(f"{name} must be bool, got dtype {arr.dtype}")
    return arr


def batch_size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise InvalidInputError(f"batch_size must be a positive int, got {value!r}")
    return int(value)


def to_numpy(value: Any) -> Any:
    """A torch tensor (any device, with or without grad) as a numpy array; anything else as
    it is. Every argument that may come from a learner passes through here."""
    if type(value) is np.ndarray or not hasattr(value, "detach"):
        return value
    value = numpy_typed(value)
    try:  # a CPU tensor without grad: its array at once, without a detached copy
        return value.numpy()
    except (RuntimeError, TypeError):  # needs grad, or on another device
        return value.detach().cpu().numpy()


def numpy_typed(tensor: Any) -> Any:
    """A torch tensor in a dtype numpy has: bfloat16 and the float8 types (what a learner
    under autocast hands over) as float32, on the tensor's device; others as they are."""
    dtype = tensor.dtype
    if dtype.is_floating_point and dtype.itemsize < 4 and str(dtype) != "torch.float16":
        return tensor.detach().float()
    return tensor


def transition_ids(ids: Any) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(to_numpy(ids)))
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidInputError(f"ids must be a 1-d array of ints, got dtype {arr.dtype} "
                                f"shape {arr.shape}")
    return arr.astype(np.int64)


def frames_out(value: Any, nbytes: int, pin_memory: bool) -> None:
    """`sample_arrays(out=...)`: a C-contiguous, writable 1-D uint8 array of at least
    `nbytes` bytes (and no `pin_memory`: a pinned batch's frames are a fresh block)."""
    if pin_memory:
        raise InvalidInputError("sample_arrays(out=..., pin_memory=True): the frames go to "
                                "`out` or to a fresh page-locked block, not both")
    if type(value) is not np.ndarray or value.dtype != np.uint8 or value.ndim != 1 \
            or not value.flags.c_contiguous or not value.flags.writeable \
            or value.size < nbytes:
        got = (f"{value.dtype} array of shape {value.shape}, contiguous "
               f"{value.flags.c_contiguous}, writable {value.flags.writeable}"
               if isinstance(value, np.ndarray) else type(value).__name__)
        raise InvalidInputError(f"out must be a C-contiguous, writable 1-D uint8 array of "
                                f"at least {nbytes:,} bytes (the batch's frames), got {got}")


def beta(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating) \
            or not math.isfinite(value) or value < 0:
        raise InvalidInputError(f"beta must be a finite number >= 0, got {value!r}")
    return float(value)


def priorities(value: Any, count: int) -> np.ndarray:
    """`count` priorities as float64, each finite and >= 0."""
    return priority_values(priority_array(value, count))


def priority_array(value: Any, count: int) -> np.ndarray:
    """`count` numbers (one per id) as a contiguous, writable float64 array; the values are
    not looked at (`priority_values` checks them)."""
    arr = np.atleast_1d(np.asarray(to_numpy(value)))
    if arr.shape != (count,) or arr.dtype.kind not in "iuf":
        raise InvalidInputError(
            f"priorities must be {count} numbers (one per id), got {arr.dtype} {arr.shape}")
    if not (arr.dtype == np.float64 and arr.flags.c_contiguous and arr.flags.writeable):
        arr = arr.astype(np.float64)  # the compiled update takes one array type only
    return arr


def priority_values(arr: np.ndarray) -> np.ndarray:
    """`arr` (float64) if every value is finite and >= 0, else `InvalidInputError`."""
    if arr.size and not (np.minimum.reduce(arr) >= 0.0  # NaN fails both
                         and np.maximum.reduce(arr) < np.inf):
        bad = arr[~(np.isfinite(arr) & (arr >= 0))][:3].tolist()
        raise InvalidInputError(f"priorities must be finite and >= 0, got {bad}")
    return arr


def id_priorities(ids: Any, values: Any) -> tuple[np.ndarray, np.ndarray]:
    """The ids and priorities of an update as `transition_ids` and `priority_array` give
    them (the values are checked where they are applied, before anything is written).

    A learner's usual call, int64 ids and float64 values of their size (numpy arrays or
    CPU tensors), passes through without a copy or a scan of the values."""
    ids, values = to_numpy(ids), to_numpy(values)
    if not (type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1
            and _plain(ids)):
        ids = transition_ids(ids)
    if type(values) is np.ndarray and values.dtype == np.float64 \
            and values.shape == ids.shape and _plain(values):
        return ids, values
    return ids, priority_array(values, ids.size)


def _plain(arr: np.ndarray) -> bool:
    """Contiguous and writable: the one array type the compiled kernels are built for."""
    flags = arr.flags
    return bool(flags.c_contiguous and flags.writeable)


AUTO_CACHE_BYTES = 256 << 20


CACHE_ALL = "all"  # `cache_bytes` that keeps every frame of the ring decoded in RAM
CacheBytes = int | str | None  # a checked `cache_bytes`: an int >= 0, `CACHE_ALL` or None


def cache_bytes(value: Any) -> CacheBytes:
    """The `cache_bytes` argument: an int >= 0, ``"all"`` (`CACHE_ALL`: the ring's decoded
    size, every frame decoded in RAM as cpprb keeps them), or None to let `cache_budget`
    pick."""
    if value is None or (isinstance(value, str) and value == CACHE_ALL):
        return value
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise InvalidInputError(
            f"cache_bytes must be an int >= 0, {CACHE_ALL!r} or None, got {value!r}")
    return int(value)


def cache_budget(spec: StoreSpec, value: CacheBytes) -> int:
    """The decoded-chunk cache budget for a checked `cache_bytes`.

    A cache hit saves one small file read and an lz4 decode but costs a copy, and a
    miss costs a copy in, so it only pays when most reads hit: by default decoded
    chunks are cached when all of them fit in 256 MiB (small observations), and
    otherwise not at all (the OS page cache then holds the compressed frame files).
    ``"all"`` caches every chunk of the ring (`StoreSpec.decoded_bytes`).
    """
    chunks = spec.decoded_bytes  # the ring's last chunk may be short on disk; decoded, whole
    if value == CACHE_ALL:
        return chunks
    if value is not None:
        return int(value)
    return chunks if chunks <= AUTO_CACHE_BYTES else 0


def scalar_step_checker(spec: StoreSpec) -> Callable[..., tuple[Any, ...] | None] | None:
    """A fast check of one single-env step, or None if the store has more envs.

    The step must come unbatched: `action` a plain int (integer action dtype, no action
    shape) or a numpy array of exactly the action's shape and dtype, `reward` a plain or
    numpy real, `next_obs` a numpy array of exactly the observation's shape and dtype, the
    flags plain or numpy bools. The checker returns ``(action, reward, terminated,
    truncated)`` when every argument is exactly what the general checks would accept
    unchanged, and None otherwise (the caller then runs the general checks, which raise
    or convert).
    """
    if spec.num_envs != 1:
        return None
    action_dtype, obs_dtype = np.dtype(spec.action_dtype), np.dtype(spec.obs_dtype)
    plain_ints = not spec.action_shape and action_dtype.kind in "iu"
    info = np.iinfo(action_dtype) if action_dtype.kind in "iu" else None
    low, high = (int(info.min), int(info.max)) if info is not None else (0, 0)
    shape, action_shape = spec.obs_shape, spec.action_shape
    float_obs, float_action = obs_dtype.kind == "f", action_dtype.kind == "f"
    ints, reals = (int, np.integer), (int, float, np.integer, np.floating)
    flag_types = (bool, np.bool_)

    def plain_action(action: Any) -> bool:
        if type(action) is np.ndarray:
            return action.shape == action_shape and action.dtype == action_dtype and (
                not float_action or math.isfinite(action.sum()))
        return plain_ints and isinstance(action, ints) and not isinstance(action, bool) \
            and low <= action <= high

    def check(action: Any, reward: Any, obs: Any, terminated: Any,
              truncated: Any) -> tuple[Any, ...] | None:
        if type(terminated) not in flag_types or type(truncated) not in flag_types \
                or type(obs) is not np.ndarray or obs.shape != shape or obs.dtype != obs_dtype \
                or not isinstance(reward, reals) or isinstance(reward, bool):
            return None
        # a sum is finite only if every element is (one that overflows takes the long path)
        if not plain_action(action) or not math.isfinite(reward) \
                or (float_obs and not math.isfinite(obs.sum())):
            return None
        return action, float(reward), bool(terminated), bool(truncated)

    return check


def extras(spec: StoreSpec, value: Any, count: int) -> dict[str, np.ndarray]:
    """The ``extras`` of an ``add``: every declared name, none other, each with a leading
    dimension of `count` envs (unbatched with one env) and a dtype of the same kind."""
    declared = {name: (shape, dtype) for name, shape, dtype in spec.extras}
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise InvalidInputError(
            f"extras must be a dict {{name: array}}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(declared), key=str)
    missing = sorted(set(declared) - set(value))
    if unknown or missing:
        raise InvalidInputError(
            f"extras must be exactly the declared {sorted(declared)}: "
            f"unknown {unknown}, missing {missing}")
    out = {}
    for name, (shape, dtype) in declared.items():
        arr = per_env(spec, f"extra {name!r}", to_numpy(value[name]), shape, count)
        want = np.dtype(dtype)
        if arr.dtype.kind not in "biuf" or not np.can_cast(arr.dtype, want, "same_kind") \
                or (arr.dtype.kind == "b") != (want.kind == "b"):
            raise InvalidInputError(f"extra {name!r} dtype {arr.dtype} cannot be stored as {want}")
        out[name] = arr.astype(want)
    return out


def sequence_key(spec: StoreSpec, length: Any, cross_episodes: Any, period: Any) -> tuple[
        int, bool, int]:
    """``(length, cross_episodes, period)`` of a sequence request, checked."""
    if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 1:
        raise InvalidInputError(f"length must be a positive int, got {length!r}")
    if length > spec.slots_per_env - 1:
        raise InvalidInputError(
            f"length {length} exceeds what one env keeps: capacity // num_envs = "
            f"{spec.slots_per_env} frames hold at most {spec.slots_per_env - 1} steps")
    if not isinstance(cross_episodes, bool | np.bool_):
        raise InvalidInputError(f"cross_episodes must be a bool, got {cross_episodes!r}")
    if isinstance(period, bool) or not isinstance(period, int | np.integer) \
            or not 1 <= period <= spec.slots_per_env:
        raise InvalidInputError(
            f"period must be an int in [1, {spec.slots_per_env}], got {period!r}")
    return int(length), bool(cross_episodes), int(period)


def sequence_priorities(ids: Any, td_errors: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(B, T)`` int ids and ``(B, T)`` finite float TD errors (torch tensors accepted)."""
    rows, errors = np.asarray(to_numpy(ids)), np.asarray(to_numpy(td_errors))
    if rows.ndim != 2 or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
        raise InvalidInputError(f"ids must be a (B, T) int array of a SequenceBatch, got "
                                f"{rows.dtype} {rows.shape}")
    if errors.shape != rows.shape or errors.dtype.kind not in "iuf":
        raise InvalidInputError(f"td_errors must be numbers of the ids' shape {rows.shape}, "
                                f"got {errors.dtype} {errors.shape}")
    errors = errors.astype(np.float64)
    if not np.isfinite(errors).all():
        raise InvalidInputError("td_errors must be finite")
    return rows.astype(np.int64), errors


def unit_interval(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating) \
            or not 0.0 <= float(value) <= 1.0:
        raise InvalidInputError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)
