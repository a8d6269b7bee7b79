"""Targets: each figure beside the goal it is read against (PASS / SHORT), never asserted.
"""

from __future__ import annotations

from typing import Any

from benchlib.config import Args


def verdict(ok: bool) -> str:
    return "PASS" if ok else "SHORT"


def find_row(rows: list[dict[str, Any]], system: str, frames: int) -> dict[str, Any] | None:
    for row in rows:
        if row["system"] == system and row["frames"] == frames and "skipped" not in row:
            return row
    return None


def ram_targets(result: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The add-rate target always; RAM and add ratios only when cpprb (`bench` extra) ran."""
    mm, cp = (find_row(result.get("ram", []), s, n) for s in ("mmreplay", "cpprb"))
    if mm is None:
        return []
    x = mm["steps_per_s"]
    rows = [target(f"add: mmreplay steps/s, {n:,}-frame fill", f"{x:,.0f}", ">= 50,000",
                   x >= 50e3)]
    if cp is None:
        return rows
    a, b = mm["growth_mib"]["VmRSS"], cp["growth_mib"]["VmRSS"]
    y = cp["steps_per_s"]
    return [
        target(f"RAM: RSS growth mmreplay / cpprb, {n:,} frames",
               f"{a:,.0f} / {b:,.0f} MiB = {100 * a / b:.1f}%", "<= 10%", a <= 0.1 * b),
        *rows,
        target("add: mmreplay / cpprb steps/s", f"{x:,.0f} / {y:,.0f} = {x / y:.2f}x",
               ">= 2.5x", x >= 2.5 * y),
    ]


def sample_targets(result: dict[str, Any], n: int) -> list[dict[str, Any]]:
    cold, cp = result.get("cold"), find_row(result.get("ram", []), "cpprb", n)
    if cold is None:
        return []
    mm = cold["warm"]["median_ms"]
    naive = cold["naive_warm"]["median_ms"]
    rows = [target(f"sample: naive zarr / mmreplay cold, {n:,} frames",
                   f"{naive:.1f} / {mm:.2f} ms = {naive / mm:.0f}x", ">= 30x", naive >= 30 * mm)]
    if cp is not None:
        c = cp["sample"]["median_ms"]
        rows.insert(0, target(f"sample: mmreplay cold / cpprb, {n:,} frames",
                              f"{mm:.2f} / {c:.2f} ms = {mm / c:.1f}x", "<= 3x", mm <= 3 * c))
    return rows


def target(figure: str, measured: str, goal: str, ok: bool) -> dict[str, Any]:
    return {"figure": figure, "measured": measured, "target": goal, "verdict": verdict(ok)}


def targets(result: dict[str, Any], args: Args) -> list[dict[str, Any]]:
    rows = ram_targets(result, args.scale_frames) + sample_targets(result, args.scale_frames)
    for game in result.get("disk_games", []):
        rows.append(target(f"disk: {game['game']} files / raw",
                           f"{game['file_pct']:.1f}%", "<= 10%", game["file_pct"] <= 10))
        rows.append(target(f"disk: {game['game']} allocated blocks / raw",
                           f"{game['allocated_pct']:.1f}%", "<= 10%",
                           game["allocated_pct"] <= 10))
    if "open" in result:
        s = result["open"]["cold"]["total_s"]
        rows.append(target(f"open + first batch, {args.scale_frames:,} frames, evicted",
                           f"{s:.2f} s", "<= 2 s", s <= 2))
    if "flush" in result:
        f = result["flush"]
        rows.append(target(
            f"flush after {args.flush_steps:,} steps: {f['big']['capacity']:,} / "
            f"{f['small']['capacity']:,} store",
            f"{f['big']['median_s'] * 1e3:.0f} / {f['small']['median_s'] * 1e3:.0f} ms = "
            f"{f['ratio']:.1f}x", "<= 2x (O(steps))", f["ratio"] <= 2))
    return rows


def print_targets(rows: list[dict[str, Any]]) -> None:
    print("\ntargets (measured on this machine; SHORT = target not met):")
    for r in rows:
        print(f"  {r['figure']:<52}{r['measured']:>34}  {r['target']:<18}{r['verdict']}")
