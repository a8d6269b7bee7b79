"""Frames to image files: labelled contact sheets, PNG and GIF bytes (Pillow), MP4 (PyAV).

Used by `mmreplay show` and the viewer (`tools/view`). Inputs are uint8 images as
`inspection.as_images` returns them, ``(N, H, W)`` or ``(N, H, W, C)``. A sheet lays cells
out row-major; each cell is a frame enlarged `scale` times (nearest neighbour) above its
label lines::

    +-----------------------------+
    | title                       |
    +---------+  +---------+      |
    |  frame  |  |  frame  |  ... |
    +---------+  +---------+      |
    | label 1 |  | label 1 |      |
    | label 2 |  | label 2 |      |
    +-----------------------------+

Pillow and PyAV (``av``, whose wheels bundle FFmpeg's libraries: nothing is downloaded at run
time) are optional (the ``view`` extra; Pillow also in ``tools``): each is imported when a
function here needs it, never by ``import mmreplay``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmreplay.errors import MmreplayError

READABLE_PX = 168  # a frame's longer side on a sheet by default (84x84 Atari frames: 2x)
GAP = 6
PAD = 6
FONT_PX = 13
LINE_PX = 16
BACKGROUND = (24, 24, 28)
TEXT = (230, 230, 230)


class MissingExtraError(MmreplayError, ImportError):
    """An optional dependency is not installed; the message names the pip command."""


def pillow() -> Any:
    """The `PIL.Image` module, or `MissingExtraError` naming the extra to install."""
    try:
        from PIL import Image
    except ImportError:
        raise MissingExtraError('drawing frames needs Pillow: pip install "mmreplay[view]"') \
            from None
    return Image


def default_scale(height: int, width: int, target: int = READABLE_PX) -> int:
    """The integer enlargement that brings a frame's longer side to about `target` px."""
    return max(1, math.ceil(target / max(height, width, 1)))


def enlarge(images: np.ndarray, scale: int) -> np.ndarray:
    """Nearest-neighbour enlargement of ``(N, H, W[, C])`` images."""
    return images.repeat(scale, axis=1).repeat(scale, axis=2) if scale > 1 else images


def labelled_sheet(images: np.ndarray, labels: Sequence[Sequence[str]], *, cols: int,
                   scale: int, title: str | None = None) -> Any:
    """A `PIL.Image` (RGB) of `images` in a grid `cols` wide, each above its label lines."""
    image_mod = pillow()
    from PIL import ImageDraw

    big = _rgb(enlarge(images, scale))
    n, h, w = big.shape[:3]
    lines = max((len(lab) for lab in labels), default=0)
    cell_h = h + lines * LINE_PX
    rows = max(1, -(-n // cols))
    top = PAD + (LINE_PX + PAD if title else 0)
    size = (2 * PAD + cols * w + (cols - 1) * GAP, top + rows * cell_h + (rows - 1) * GAP + PAD)
    sheet = image_mod.new("RGB", size, BACKGROUND)
    draw, font = ImageDraw.Draw(sheet), _font()
    if title:
        draw.text((PAD, PAD), title, fill=TEXT, font=font)
    for i in range(n):
        x, y = cell_origin(i, cols=cols, cell=(cell_h, w), top=top)
        sheet.paste(image_mod.fromarray(big[i]), (x, y))
        for j, text in enumerate(labels[i] if i < len(labels) else ()):
            draw.text((x, y + h + j * LINE_PX + 1), text, fill=TEXT, font=font)
    return sheet


def cell_origin(i: int, *, cols: int, cell: tuple[int, int], top: int) -> tuple[int, int]:
    """(x, y) of the top-left pixel of cell `i`'s frame on a `labelled_sheet`; `cell` is
    (cell height including labels, frame width) and `top` the height above the first row."""
    r, c = divmod(i, cols)
    return PAD + c * (cell[1] + GAP), top + r * (cell[0] + GAP)


def png_bytes(image: np.ndarray | Any) -> bytes:
    """PNG bytes of a uint8 array ``(H, W[, C])`` or a `PIL.Image`."""
    picture = pillow().fromarray(image) if isinstance(image, np.ndarray) else image
    out = io.BytesIO()
    picture.save(out, format="PNG", compress_level=3)
    return out.getvalue()


def gif_bytes(images: np.ndarray, *, fps: int, scale: int = 1) -> bytes:
    """An animated GIF (looping) of ``(N, H, W[, C])`` uint8 frames."""
    image_mod = pillow()
    frames = [image_mod.fromarray(f) for f in enlarge(images, scale)]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], loop=0,
                   duration=max(1, round(1000 / fps)))
    return out.getvalue()


def pyav() -> Any:
    """The `av` module (PyAV), or `MissingExtraError` naming the extra to install."""
    try:
        import av
    except ImportError:
        raise MissingExtraError('MP4 export needs PyAV: pip install "mmreplay[view]"') from None
    return av


def mp4_bytes(images: np.ndarray, *, fps: int, scale: int = 1, lossless: bool = False) -> bytes:
    """An H.264 MP4 of ``(N, H, W[, C])`` uint8 frames, enlarged `scale` times.

    Default: ``yuv420p`` at CRF 18, which every browser and player plays; odd sides are
    padded by one edge pixel (4:2:0 needs even sides). ``lossless``: RGB H.264 at QP 0
    (``libx264rgb``), bit-exact frames but a profile (High 4:4:4) few browsers play.
    """
    av = pyav()
    rgb = _rgb(enlarge(images, scale))
    if not lossless:
        h, w = rgb.shape[1:3]
        rgb = np.pad(rgb, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264rgb" if lossless else "libx264", rate=fps)
        stream.height, stream.width = rgb.shape[1:3]
        stream.pix_fmt = "rgb24" if lossless else "yuv420p"
        stream.options = {"qp": "0"} if lossless else {"crf": "18"}
        for image in rgb:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder
    return out.getvalue()


def _rgb(images: np.ndarray) -> np.ndarray:
    if images.ndim == 3:
        return np.repeat(images[..., None], 3, axis=-1)
    if images.shape[-1] == 4:
        return images[..., :3]
    return images


def _font() -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=FONT_PX)
    except (TypeError, OSError):  # Pillow without FreeType: the small bitmap font
        return ImageFont.load_default()
