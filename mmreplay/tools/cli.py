"""The ``mmreplay`` command: a thin terminal layer over `tools.inspection` and the importers.

    mmreplay info PATH [--json]              config, counts, disk, RAM, sampler
    mmreplay episodes PATH [--sort K] [--limit N] [--json]
    mmreplay show PATH ID [--out F]          a transition's stacks as a PNG grid
    mmreplay show PATH --episode N [--gif]   an episode's frames (PNG sheet or GIF)
    mmreplay plot PATH [--out F]             the sampler's view and histograms (PNG)
    mmreplay verify PATH                     every checksum and invariant; exit 1 if damaged
    mmreplay sample PATH [--batch-size B] [--seed S]
    mmreplay view PATH [--port N] [--host 127.0.0.1]   a local web viewer (read-only)
    mmreplay import-dopamine DIR STORE [--checkpoints 0-3]   Dopamine replay logs -> store
    mmreplay export-minari STORE DATASET_ID                  store -> Minari dataset
    mmreplay import-minari DATASET_ID STORE                  Minari dataset -> store
    mmreplay push STORE URL [--take-over]    upload to s3://bucket/prefix (only what changed)
    mmreplay pull URL DIR                    download the newest generation and verify it

PATH may also be a URL (s3://bucket/prefix, file:///dir): the store is read from there.

The inspecting commands open the store read-only (no lock, nothing written), so they are
safe on a store another process is writing; the import commands build a new store beside
STORE and rename it into place only when it is complete. Exit codes: 0 ok, 1 ``verify``
found problems, 2 a user mistake (bad arguments, not a store, damaged store), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from mmreplay import __version__
from mmreplay.errors import MmreplayError
from mmreplay.storage.objects import is_url
from mmreplay.tools import inspection as ins
from mmreplay.tools import render, show_labels
from mmreplay.tools.cli_datasets import add_dataset_commands
from mmreplay.tools.cli_remote import add_remote_commands, verify_url
from mmreplay.tools.images import as_images, is_image_shape, tile
from mmreplay.tools.steps import episode_frames, episode_steps, transition
from mmreplay.tools.verify import verify_store

PROG = "mmreplay"
PRIORITY_OPTIONS = ("alpha", "priority_eps")  # spec fields a uniform store does not use


class UsageError(Exception):
    """A command-line mistake argparse cannot see (exit code 2)."""


# -- entry point ------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or an argparse error (already printed)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.run(args))
    except BrokenPipeError:  # e.g. `mmreplay episodes PATH | head`
        sys.stderr.close()  # the pipe's reader left; say nothing more
        return 0
    except (MmreplayError, OSError, UsageError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect an mmreplay store (read-only: safe while it is being "
                               "written).")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_info, _add_episodes, _add_show, _add_plot, _add_verify, _add_sample,
                _add_view):
        add(sub)
    add_dataset_commands(sub, positive_int=_positive_int)
    add_remote_commands(sub)
    return parser


def _command(sub: Any, name: str, help_text: str, run: Any) -> argparse.ArgumentParser:
    cmd = sub.add_parser(name, help=help_text, description=help_text)
    cmd.add_argument("path", metavar="PATH", help="store directory, or s3://bucket/prefix")
    cmd.set_defaults(run=run)
    return cmd


# -- info -------------------------------------------------------------------------------
def _add_info(sub: Any) -> None:
    cmd = _command(sub, "info", "config, counts, disk and RAM use, sampler statistics", cmd_info)
    cmd.add_argument("--json", action="store_true", help="print JSON instead of text")


def cmd_info(args: argparse.Namespace) -> int:
    with ins.open_readonly(args.path) as store:
        info = ins.store_info(store)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    for title, pairs in _info_sections(info):
        _print_section(title, pairs)
    return 0


def _info_sections(info: ins.StoreInfo) -> list[tuple[str, list[tuple[str, str]]]]:
    c, d, r = info.counts, info.disk, info.ram
    ratio = "n/a (no frame kept yet)" if d.compression_ratio is None else \
        f"{d.compression_ratio:.1f}x (raw kept frames / all files)"
    cache = "none: reads decode from the frame files" if r.cache_budget_bytes == 0 else \
        f"up to {_size(r.cache_budget_bytes)}, on demand"
    sections = [
        ("store", [("path", info.path), ("format", f"mmreplay v{info.format_version}"),
                   ("generation", str(info.generation))]),
        ("config", [(k, _show_value(v)) for k, v in info.spec.items()
                    if info.sampler != "uniform" or k not in PRIORITY_OPTIONS]),
        ("counts", [("frames written", str(c.frames_written)),
                    ("frames kept", f"{c.frames_kept} ({d.frames_in_tail} in the RAM tail)"),
                    ("transitions", str(c.transitions)), ("sampleable", str(c.sampleable)),
                    ("episodes", f"{c.episodes} ({info.episodes_running} running)")]),
        ("disk", [("total", _size(d.total_bytes)),
                  ("frames", f"{_size(d.frames_bytes)} in {_plural(d.chunk_files, 'frame file')}"),
                  ("compression", ratio)]),
        ("ram (estimated)", [("step columns", _size(r.steps_bytes)),
                             ("masks", _size(r.masks_bytes)), ("sampler", _size(r.sampler_bytes)),
                             ("frame tail", _size(r.tail_bytes)), ("total", _size(r.total_bytes)),
                             ("chunk cache", cache)]),
    ]
    sections.append(("sampler", _sampler_pairs(info)))
    if info.rate_limiter is not None:
        sections.append(("rate limiter", _rate_limiter_pairs(info.rate_limiter)))
    return sections


def _rate_limiter_pairs(r: dict[str, Any]) -> list[tuple[str, str]]:
    achieved, spi = r.get("achieved_samples_per_insert"), r.get("samples_per_insert", 0.0)
    shown = "n/a (min size not reached)" if achieved is None else f"{achieved:.3f}"
    at_min = spi * r.get("min_size_to_sample", 0)
    band = f"[{r.get('min_diff', 0.0) - at_min:.6g}, {r.get('max_diff', 0.0) - at_min:.6g}]"
    return [("samples per insert", f"{shown} achieved, target {spi:g}"),
            ("inserts / samples", f"{r.get('inserts')} / {r.get('samples')}"),
            ("error", f"{r.get('error', 0.0):.6g} (limits {band})"),
            ("writers blocked", f"{r.get('insert_wait_s', 0.0):.3f} s in "
                                f"{r.get('inserts_blocked', 0)} calls"),
            ("learners blocked", f"{r.get('sample_wait_s', 0.0):.3f} s in "
                                 f"{r.get('samples_blocked', 0)} calls")]


def _sampler_pairs(info: ins.StoreInfo) -> list[tuple[str, str]]:
    pairs = [("kind", info.sampler), ("sampleable", str(info.counts.sampleable))]
    p = info.priorities
    if p is None:
        return pairs
    if p.min is None or p.mean is None or p.max is None:
        return [*pairs, ("priorities", "none sampleable yet")]
    return [*pairs, ("priority min", f"{p.min:.6g}"), ("priority mean", f"{p.mean:.6g}"),
            ("priority max", f"{p.max:.6g}"), ("new entries get", f"{p.max_priority:.6g}")]


def _print_section(title: str, pairs: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in pairs)
    print(title)
    for key, value in pairs:
        print(f"  {key:<{width}}  {value}")


def _show_value(value: Any) -> str:
    return str(tuple(value)) if isinstance(value, list | tuple) else str(value)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _size(n: int) -> str:
    """Bytes in binary units: ``512 B``, ``3.4 KiB``, ``1.2 GiB``."""
    if n < 1024:
        return f"{n} B"
    exponent = min((n.bit_length() - 1) // 10, 4)
    return f"{n / 1024 ** exponent:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[exponent - 1]}"


# -- episodes ---------------------------------------------------------------------------
EPISODE_COLUMNS = ("env", "episode", "first_id", "last_id", "length", "return", "status", "kept")


def _add_episodes(sub: Any) -> None:
    cmd = _command(sub, "episodes", "one row per episode with a kept frame", cmd_episodes)
    cmd.add_argument("--sort", choices=ins.SORT_KEYS, default="episode",
                     help="episode number (ascending) or return / length (largest first)")
    cmd.add_argument("--limit", type=_positive_int, default=None, metavar="N",
                     help="show only the first N rows")
    cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")


def cmd_episodes(args: argparse.Namespace) -> int:
    with ins.open_readonly(args.path) as store:
        rows = ins.sort_episodes(ins.episode_table(store), args.sort)
    shown = rows[:args.limit] if args.limit else rows
    if args.json:
        print(json.dumps([asdict(r) for r in shown], indent=2))
        return 0
    print(_table(EPISODE_COLUMNS, [_episode_cells(r) for r in shown]))
    partial = sum(not r.fully_kept for r in shown)
    note = f"; {partial} partly evicted (kept=partial: return and first_id cover kept steps)" \
        if partial else ""
    print(f"{len(shown)} of {len(rows)} episodes with kept frames{note}")
    return 0


def _episode_cells(r: ins.EpisodeRow) -> list[str]:
    return [str(r.env), str(r.episode), _opt(r.first_id), _opt(r.last_id), str(r.length),
            f"{r.episode_return:.6g}", r.status, "yes" if r.fully_kept else "partial"]


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _table(headers: Sequence[str], rows: list[list[str]]) -> str:
    """Columns padded to width: text left-aligned, numbers right-aligned."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    right = [all(_numeric(r[i]) for r in rows) and bool(rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if rj else c.ljust(w)
                         for c, w, rj in zip(cells, widths, right, strict=True)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return text == "-"
    return True


# -- show -------------------------------------------------------------------------------
def _add_show(sub: Any) -> None:
    cmd = _command(sub, "show", "draw a transition's stacks, or an episode's frames", cmd_show)
    cmd.add_argument("id", type=int, nargs="?", metavar="ID", help="transition id")
    cmd.add_argument("--episode", type=int, metavar="N", help="draw episode N instead")
    cmd.add_argument("--gif", action="store_true", help="with --episode: an animated GIF")
    cmd.add_argument("--fps", type=_positive_int, default=15, help="GIF frames per second")
    cmd.add_argument("--scale", type=_positive_int, default=None,
                     help="enlarge frames N times (default: about 168 px a side, 1 for a GIF)")
    cmd.add_argument("--no-labels", action="store_true",
                     help="frames only, 2 px apart on grey (no title, no labels)")
    cmd.add_argument("--out", metavar="FILE", help="output file (default: transition_<ID>.png, "
                     "episode_<N>.gif / .png)")


def cmd_show(args: argparse.Namespace) -> int:
    if (args.id is None) == (args.episode is None):
        raise UsageError("show needs either a transition ID or --episode N (not both)")
    if args.gif and args.episode is None:
        raise UsageError("--gif needs --episode N")
    image = _pillow()
    with ins.open_readonly(args.path) as store:
        shape = tuple(store.spec.obs_shape)
        if not is_image_shape(shape):
            raise UsageError(f"`show` draws image observations; {args.path} holds observations "
                             f"of shape {shape}, which are not images (try `mmreplay sample`)")
        if args.episode is not None:
            return _show_episode(image, store, args)
        view = transition(store, args.id)
    images = as_images(np.concatenate([view.obs, view.next_obs]))
    out = args.out or f"transition_{view.id}.png"
    k = view.obs.shape[0]
    if args.no_labels:
        picture = image.fromarray(tile(images, cols=k, scale=args.scale or 1))
    else:
        picture = render.labelled_sheet(images, show_labels.transition_labels(view, store.spec),
                                        cols=k, scale=_scale(args, images),
                                        title=show_labels.transition_title(view))
    _save(picture, out)
    print(f"wrote {out}: top row obs, bottom row next_obs ({k} frames each); "
          f"id {view.id}, action {view.action.tolist()}, reward {view.reward:.6g}, "
          f"discount {view.discount:.6g}, terminated {view.terminated}, "
          f"truncated {view.truncated}")
    return 0


def _scale(args: argparse.Namespace, images: np.ndarray) -> int:
    return args.scale or render.default_scale(*images.shape[1:3])


def _show_episode(image: Any, store: Any, args: argparse.Namespace) -> int:
    images = as_images(episode_frames(store, args.episode))
    if args.gif:
        out = args.out or f"episode_{args.episode}.gif"
        big = render.enlarge(images, args.scale or 1)
        frames = [image.fromarray(f) for f in big]
        _save(frames[0], out, save_all=True, append_images=frames[1:], loop=0,
              duration=max(1, round(1000 / args.fps)))
        with image.open(out) as gif:  # Pillow merges identical consecutive frames
            written = gif.n_frames
        held = f"{_plural(written, 'GIF frame')} of its {len(images)} kept frames" + \
            (" (identical consecutive frames merged)" if written < len(images) else "")
    else:
        out = args.out or f"episode_{args.episode}.png"
        cols = min(len(images), 16 if args.no_labels else 8)
        if args.no_labels:
            picture = image.fromarray(tile(images, cols=cols, scale=args.scale or 1))
        else:
            steps = episode_steps(store, args.episode)
            picture = render.labelled_sheet(
                images, show_labels.episode_labels(steps), cols=cols, scale=_scale(args, images),
                title=f"episode {args.episode} (env {steps.env}): {len(images)} kept frames")
        _save(picture, out)
        held = f"{len(images)} kept frames"
    print(f"wrote {out}: episode {args.episode}, {held}")
    return 0


def _save(target: Any, out: str, **options: Any) -> None:
    """Save an image or figure; an output name whose format is unknown is a usage error."""
    try:
        (target.savefig if hasattr(target, "savefig") else target.save)(out, **options)
    except (ValueError, KeyError) as exc:  # PIL / matplotlib: unknown file extension
        raise UsageError(f"cannot write {out}: {exc}") from None


def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise UsageError('`mmreplay show` needs pillow: pip install "mmreplay[view]"') from None
    return Image


# -- plot -------------------------------------------------------------------------------
def _add_plot(sub: Any) -> None:
    cmd = _command(sub, "plot", "what the sampler draws (P(draw) over the ring, ages) and "
                   "histograms of priorities, rewards, episode lengths and returns", cmd_plot)
    cmd.add_argument("--out", default="replay_plot.png", metavar="FILE",
                     help="output PNG (default: replay_plot.png)")
    cmd.add_argument("--bins", type=_positive_int, default=30, help="histogram bins")


def cmd_plot(args: argparse.Namespace) -> int:
    from mmreplay.tools.plots import plot_store

    with ins.open_readonly(args.path) as store:
        result = plot_store(store, bins=args.bins)
    if not result.drawn:
        raise UsageError(f"nothing to plot yet: {args.path} holds no kept step")
    _save(result.figure, args.out, dpi=100)
    skipped = f" (no data yet: {', '.join(result.skipped)})" if result.skipped else ""
    print(f"wrote {args.out}: {'; '.join(t.split(' (')[0] for t in result.drawn)}{skipped}")
    return 0


# -- verify -----------------------------------------------------------------------------
def _add_verify(sub: Any) -> None:
    _command(sub, "verify", "check every checksum and invariant; exit 1 if anything is wrong",
             cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    report = verify_url(args.path) if is_url(args.path) else verify_store(
        args.path, progress=_progress_bar)
    if report.note:
        print(f"{PROG}: note: {report.note}", file=sys.stderr)
    if not report.ok:
        for problem in report.problems:
            print(problem)
        print(f"{PROG}: {len(report.problems)} problem(s) in {report.path}", file=sys.stderr)
        return 1
    print("ok")
    print(f"generation {report.generation}: {_plural(report.files_checked, 'named file')}, "
          f"{_plural(report.chunks_checked, 'frame chunk')} "
          f"({report.frames_checked} kept frames) checked; "
          f"{report.sampleable} sampleable transitions")
    return 0


def _progress_bar(items: Iterable[Any], total: int) -> Iterable[Any]:
    """A tqdm bar on stderr over frame chunks, for stores big enough to wait on; none when
    stderr is not a terminal (a log file would keep every redraw)."""
    if total < 256 or not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, total=total, desc="chunks", unit="chunk", file=sys.stderr, leave=False)


# -- sample -----------------------------------------------------------------------------
def _add_sample(sub: Any) -> None:
    cmd = _command(sub, "sample", "draw a batch (in memory only) and describe its fields",
                   cmd_sample)
    cmd.add_argument("--batch-size", type=_positive_int, default=32, metavar="B")
    cmd.add_argument("--seed", type=int, default=None,
                     help="RNG seed (default: the store's own RNG state, i.e. the writer's next "
                          "draw)")
    cmd.add_argument("--beta", type=float, default=0.4,
                     help="importance-weight exponent for prioritized stores")


def cmd_sample(args: argparse.Namespace) -> int:
    with ins.open_readonly(args.path) as store:
        fields = ins.sample_summary(store, args.batch_size, seed=args.seed, beta=args.beta)
    rows = [[f.name, str(f.shape), f.dtype, f"{f.min:.6g}", f"{f.max:.6g}"] for f in fields]
    print(_table(("field", "shape", "dtype", "min", "max"), rows))
    return 0


# -- view ---------------------------------------------------------------------------------
def _add_view(sub: Any) -> None:
    cmd = _command(sub, "view", "a local web viewer of the store (read-only; follows a "
                   "store being written)", cmd_view)
    cmd.add_argument("--port", type=int, default=8765,
                     help="port (default 8765; 0 picks a free one)")
    cmd.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default 127.0.0.1: this machine only)")
    cmd.add_argument("--log", action="store_true", help="log each request on stderr")


def cmd_view(args: argparse.Namespace) -> int:
    from mmreplay.tools.view import make_server

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {args.port}")
    server = make_server(args.path, host=args.host, port=args.port, log=args.log)
    print(f"serving {args.path} at {server.url} (read-only; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


# -- argument types -----------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
