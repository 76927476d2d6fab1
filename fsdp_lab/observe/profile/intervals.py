"""Interval arithmetic on sorted, disjoint intervals (microseconds, as traces count them).

Busy time is the length of a union, never a sum of durations: kernels on several streams, nested
operators and a collective split by compute overlap, and summed durations count the overlap
twice. ``union`` turns any intervals into the sorted, disjoint form the other functions take.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint, non-empty intervals covering the same points (touching ones merge)."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: Iterable[Interval]) -> float:
    """The total length of disjoint intervals."""
    return sum(e - s for s, e in intervals)


def clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of sorted, disjoint ``intervals`` inside [lo, hi]."""
    first = bisect.bisect_right(intervals, (lo, float("inf"))) - 1
    out = []
    for s, e in intervals[max(first, 0) :]:
        if s >= hi:
            break
        if e > lo:
            out.append((max(s, lo), min(e, hi)))
    return out


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The points in both of two sorted, disjoint lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The points of ``a`` not in ``b`` (both sorted and disjoint)."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def close_gaps(intervals: list[Interval], gap: float) -> list[Interval]:
    """Merge neighbours closer than ``gap`` (for a picture, where a gap below a pixel is noise)."""
    out: list[Interval] = []
    for s, e in intervals:
        if out and s - out[-1][1] < gap:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out
