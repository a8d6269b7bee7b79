"""Observations as pictures: uint8 image grids for `mmreplay show`, `plot` and the viewer.

Pure numpy, no store: which observation shapes are images (`is_image_shape`), frames as
``(N, H, W[, C])`` uint8 (`as_images`), and images laid out in a grid (`tile`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mmreplay.errors import InvalidInputError


def is_image_shape(obs_shape: Sequence[int]) -> bool:
    """True for observations `as_images` draws as pictures: (H, W), (H, W, C) or (C, H, W)
    with C in 1, 3, 4. Vectors and other layouts are not images."""
    shape = tuple(obs_shape)
    if len(shape) == 2:
        return True
    return len(shape) == 3 and (shape[-1] in (1, 3, 4) or shape[0] in (1, 3, 4))


def as_images(frames: np.ndarray) -> np.ndarray:
    """Frames ``(N, *obs_shape)`` as uint8 images ``(N, H, W)`` or ``(N, H, W, C)``.

    Accepts (H, W), (H, W, C) and (C, H, W) observations with C in 1, 3, 4, and 1-D
    vectors (drawn as a one-pixel-high strip). Non-uint8 values are scaled min..max to 0..255.
    """
    shape = frames.shape[1:]
    if len(shape) == 1:
        frames = frames[:, None, :]
    elif len(shape) == 3 and shape[-1] not in (1, 3, 4) and shape[0] in (1, 3, 4):
        frames = np.moveaxis(frames, 1, -1)
    elif len(shape) != 2 and not (len(shape) == 3 and shape[-1] in (1, 3, 4)):
        raise InvalidInputError(f"cannot draw observations of shape {shape}: expected "
                                f"(H, W), (H, W, C) or (C, H, W) with C in 1, 3, 4")
    if frames.ndim == 4 and frames.shape[-1] == 1:
        frames = frames[..., 0]
    return _to_uint8(frames)


def _to_uint8(frames: np.ndarray) -> np.ndarray:
    if frames.dtype == np.uint8:
        return frames
    values = frames.astype(np.float64)
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    if high <= low:
        return np.zeros(frames.shape, np.uint8)
    return np.round((values - low) * (255.0 / (high - low))).astype(np.uint8)


def tile(images: np.ndarray, *, cols: int, scale: int = 1, gap: int = 2,
         fill: int = 128) -> np.ndarray:
    """Lay images ``(N, H, W[, C])`` out row-major in a grid `cols` wide.

    Each image is enlarged `scale` times (nearest neighbour); cells are `gap` pixels
    apart on a `fill` background. Result: ``rows*H*scale + (rows-1)*gap`` high.
    """
    n = images.shape[0]
    rows = max(1, -(-n // cols))
    big = images.repeat(scale, axis=1).repeat(scale, axis=2)
    h, w = big.shape[1:3]
    out = np.full((rows * h + (rows - 1) * gap, cols * w + (cols - 1) * gap, *big.shape[3:]),
                  fill, np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        out[r * (h + gap):r * (h + gap) + h, c * (w + gap):c * (w + gap) + w] = big[i]
    return out
