"""The KV store's settings (`StoreConfig`, a user config of `jkv.config`): its own module
because the store's tiers, placement and AdaptCache knobs are a group of their own, with the
host tier's default read off the machine at start."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from jkv.config_checks import check_choices_and_flags, is_int, require
from jkv.kv.format import KV_FORMATS

# the placements of jkv.store.placement and jkv.policies.adaptcache
EVICTION_POLICIES = ("lru", "fifo", "scheduler", "adaptcache")
HOST_CACHE_SHARE = 4  # the default host tier: a quarter of the memory available at start,
HOST_CACHE_CAP = 8 << 30  # at most 8 GiB


def default_host_cache_bytes() -> int:
    """A quarter of the host memory available now, at most 8 GiB (0 where unknown)."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
    return min(available // HOST_CACHE_SHARE, HOST_CACHE_CAP)


def _host_cache_note() -> str:
    return f"here {default_host_cache_bytes() / 2**30:.1f} GiB"


@dataclass(frozen=True)
class StoreConfig:
    """Where finished requests' KV is kept off the device (`jkv.store`): a host-memory tier and
    a persistent tier.

    host_cache_bytes None is resolved here, when the config is made.
    """

    host_cache_bytes: int | None = field(default=None, metadata={
        "help": "host memory for the KV store: finished requests' KV kept off the device, "
                "restored (not recomputed) when a later turn needs it; 0 turns the host tier "
                "off; default: a quarter of free memory at start, at most 8 GiB",
        "default_note": _host_cache_note})
    disk_cache_bytes: int = field(default=64 << 30, metadata={
        "help": "most bytes the persistent KV tier holds (in a directory also at most a "
                "third of what its filesystem has room for: evicted entries' bytes stay on "
                "disk until the store compacts it)"})
    store_dir: str | os.PathLike | None = field(default=None, metadata={
        "help": "directory of the persistent KV tier (tensorstore OCDBT: atomic commits, "
                "reused by the next process opened on it); default: none"})
    store_spec: str | dict | None = field(default=None, metadata={
        "help": "the persistent KV tier as a tensorstore kvstore spec (a dict; JSON text on the "
                "command line) or URL instead of `store_dir`, e.g. s3://bucket/prefix/"})
    store_coordinator: str | None = field(default=None, metadata={
        "help": "HOST:PORT of a tensorstore OCDBT coordinator "
                "(ts.ocdbt.DistributedCoordinatorServer) through which several processes "
                "(replicas) write one persistent KV tier at once: each takes up the others' "
                "entries within a second, its host tier stays its own; needs store_dir or "
                "store_spec. `python -m jkv.cluster` starts one for its replicas; default: "
                "this process writes the tier alone"})
    eviction_policy: str = field(default="scheduler", metadata={
        "help": "which stored entry a full tier gives up: scheduler (keeps and prefetches the "
                "entries of queued requests, CachedAttention), lru, fifo, or adaptcache (each "
                "entry's form and tier by marginal utility, AdaptCache: smaller forms restore "
                "approximate KV; its quality profile is --adapt-profile. Block pages: forms are "
                "KV formats, the pool in the model dtype; under a token policy (leankv, h2o...): "
                "a stored row's tokens dropped, streaming@<keep> or h2o@<keep>)",
        "choices": EVICTION_POLICIES})
    store_kv_format: str | None = field(default=None, metadata={
        "help": "KV format the store writes entries in (a fixed smaller form: k8v4t, k4v2t, "
                "k2v2 (KIVI's)...; it restores approximate KV, never shared under its tokens' "
                "hashes in the device cache, and keeps what a conversation restored from it "
                "computes next, marked approximate); one of the kv_format names; default: "
                "the pool's own"})
    kv_sharing: str = field(default="none", metadata={
        "help": "cross-layer shared KV in the store (Krul): none, or krul, which keeps each stored "
                "conversation as one basis per group of adjacent layers and per-token quantized "
                "coefficients, the groups and ranks chosen from its own KV on the store's "
                "writer thread, at `kv_sharing_rate`; an entry that form would keep poorly "
                "stays in the pool's format. Restores approximate KV like store_kv_format. It "
                "pays where a model's adjacent layers share a KV subspace; on SmolLM2-135M it is "
                "at best on par with the quantized formats at equal bytes (docs/results.md)",
        "choices": ("none", "krul")})
    kv_sharing_rate: float = field(default=0.3, metadata={
        "help": "bytes of a shared-layer entry (with kv_sharing krul) over the same tokens' "
                "bfloat16 pages, bases and scales included"})
    adapt_profile: str | None = field(default=None, metadata={
        "help": "AdaptCache's quality profile (with `eviction_policy` adaptcache): the quality "
                "of the compressed forms (JSON, written by benchmarks/adapt_profile.py, or for "
                "a token-tier engine's rows by benchmarks/adapt_rows.py), with each form's "
                "decode rate per backend (assumed until the store measures its own); "
                "default: the one jkv ships, measured on the embedded SmolLM2-135M (measure "
                "your model's own)"})
    adapt_alpha: float = field(default=1.0, metadata={
        "help": "AdaptCache's quality weight (with `eviction_policy` adaptcache): seconds of "
                "load time a whole unit of answer quality is worth (higher keeps entries "
                "larger)"})
    adapt_quality_floor: float = field(default=0.0, metadata={
        "help": "AdaptCache's quality floor (with `eviction_policy` adaptcache): a form below "
                "this quality is never kept (the entry is evicted instead)"})
    adapt_half_life: float | None = field(default=None, metadata={
        "help": "AdaptCache's reuse half-life (with `eviction_policy` adaptcache): seconds over "
                "which an entry's count of uses halves (its expected reuse), so conversations "
                "gone quiet stop holding room; default: learned, twice the median gap "
                "between an entry's uses (the users' think time between turns), 600 until "
                "one is seen"})
    save_interval_blocks: int = field(default=16, metadata={
        "help": "pages between a decoding request's saves: while a request decodes, its KV "
                "blocks (pages) are queued for the store each time this many more have "
                "filled, each save only the blocks since the last, so a finishing request has "
                "little left to save; 0: saved only when it finishes or is preempted"})

    def __post_init__(self) -> None:
        if self.host_cache_bytes is None:
            object.__setattr__(self, "host_cache_bytes", default_host_cache_bytes())
        for name in ("host_cache_bytes", "disk_cache_bytes", "save_interval_blocks"):
            value = getattr(self, name)
            require(self, name, is_int(value) and value >= 0, "an integer >= 0")
        if isinstance(self.store_dir, os.PathLike):
            object.__setattr__(self, "store_dir", os.fspath(self.store_dir))
        require(self, "store_dir", self.store_dir is None or isinstance(self.store_dir, str),
                "a path or None")
        require(self, "store_spec", self.store_spec is None
                or isinstance(self.store_spec, str | dict), "a string, a dict or None")
        if self.store_dir is not None and self.store_spec is not None:
            raise ValueError("give StoreConfig.store_dir or StoreConfig.store_spec, not both")
        require(self, "store_coordinator", self.store_coordinator is None or (
            isinstance(self.store_coordinator, str)
            and re.fullmatch(r"[^\s:/]+:\d{1,5}", self.store_coordinator) is not None),
                "None or HOST:PORT")
        require(self, "store_coordinator", self.store_coordinator is None
                or self.persistent is not None,
                "given with store_dir or store_spec (the tier it coordinates)")
        require(self, "adapt_alpha", isinstance(self.adapt_alpha, int | float)
                and not isinstance(self.adapt_alpha, bool) and self.adapt_alpha >= 0,
                "a number >= 0")
        require(self, "adapt_half_life", self.adapt_half_life is None or (
            isinstance(self.adapt_half_life, int | float)
            and not isinstance(self.adapt_half_life, bool) and self.adapt_half_life > 0),
                "None (learned) or a number > 0")
        require(self, "adapt_quality_floor", isinstance(self.adapt_quality_floor, int | float)
                and 0 <= self.adapt_quality_floor <= 1, "a number in [0, 1]")
        require(self, "store_kv_format", self.store_kv_format is None
                or self.store_kv_format in KV_FORMATS, f"None or one of {sorted(KV_FORMATS)}")
        require(self, "store_kv_format", self.store_kv_format is None
                or self.eviction_policy != "adaptcache",
                "None with eviction_policy adaptcache (it picks each entry's format)")
        require(self, "kv_sharing_rate", isinstance(self.kv_sharing_rate, int | float)
                and not isinstance(self.kv_sharing_rate, bool)
                and 0 < self.kv_sharing_rate < 1, "a number in (0, 1)")
        if self.kv_sharing != "none" and self.store_kv_format is not None:
            raise ValueError(f"StoreConfig.kv_sharing {self.kv_sharing!r} and "
                             f"StoreConfig.store_kv_format {self.store_kv_format!r} both set "
                             "the store's form: give one")
        if self.kv_sharing != "none" and self.eviction_policy == "adaptcache":
            raise ValueError(f"StoreConfig.kv_sharing {self.kv_sharing!r} and "
                             "StoreConfig.eviction_policy 'adaptcache' both choose entries' "
                             "forms: give one (adaptcache takes the shared-layer forms "
                             "krul@<rate> its profile rates)")
        require(self, "adapt_profile", self.adapt_profile is None
                or self.eviction_policy == "adaptcache",
                "None unless eviction_policy is adaptcache")
        check_choices_and_flags(self)

    @property
    def persistent(self) -> str | dict | None:
        """The persistent tier's location, or None."""
        return self.store_dir if self.store_spec is None else self.store_spec

    @property
    def enabled(self) -> bool:
        return self.host_cache_bytes > 0 or (self.persistent is not None
                                             and self.disk_cache_bytes > 0)
