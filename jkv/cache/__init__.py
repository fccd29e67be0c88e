"""Device-side KV state: the page pool, page tables and attention over pages."""

from jkv.cache.attention import paged_attention
from jkv.cache.page_pool import (
    FreeList,
    PagePool,
    PageTables,
    init_pool,
    init_tables,
    release,
    reserve,
    write_kv,
)

__all__ = ["FreeList", "PagePool", "PageTables", "init_pool", "init_tables", "paged_attention",
           "release", "reserve", "write_kv"]
