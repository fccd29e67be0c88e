"""Sizes padded to a few buckets, so compiled shapes come from a small closed set."""


def bucket(n: int, minimum: int = 1, base: int = 2) -> int:
    """The smallest power of `base` times `minimum` that is >= n."""
    b = minimum
    while b < n:
        b *= base
    return b


def decode_bucket(n: int, shape_step: int) -> int:
    """Decode rows padded for a step: powers of `shape_step` where padding is cheap (4, a
    GPU); on a CPU (2) every count up to 8, then 12, 16, 24, 32, 48...: there a padded row
    costs its matmuls, and the step costs, learned per padded size, would read a fifth
    decode as what a step of eight costs."""
    if shape_step != 2:
        return bucket(n, 1, shape_step)
    if n <= 8:
        return max(n, 1)
    b = 8
    while b < n:
        b = b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
    return b
