"""Sizes padded to a few buckets, so compiled shapes come from a small closed set."""


def bucket(n: int, minimum: int = 1, base: int = 2) -> int:
    """The smallest power of `base` times `minimum` that is >= n."""
    b = minimum
    while b < n:
        b *= base
    return b
