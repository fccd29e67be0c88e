"""A covering design for kernel tests whose cases are formats x shapes: every pair costs a
compilation in interpret mode, while a format's arithmetic and a shape's tiling fail apart."""

from __future__ import annotations


def rotated_cover(formats: list[tuple], shapes: list[tuple], per_format: int,
                  stride: int) -> list[tuple]:
    """Each format joined with `per_format` of the shapes: format i with shapes i, i + stride,
    ... (mod the number of shapes), so that the shapes are met about equally often."""
    return [(*f, *shapes[(i + stride * j) % len(shapes)])
            for i, f in enumerate(formats) for j in range(per_format)]
