"""Device-side KV state: the page pool, page tables, filling pages and attention over them."""

from jkv.cache.attention import paged_attention
from jkv.cache.kv_write import Window, append_kv
from jkv.cache.page_pool import (
    FillingPages,
    FreeList,
    PagePool,
    PageTables,
    init_filling,
    init_pool,
    init_tables,
    page_bytes,
    release,
    reserve,
)

__all__ = ["FillingPages", "FreeList", "PagePool", "PageTables", "Window",
           "append_kv", "init_filling", "init_pool", "init_tables", "page_bytes",
           "paged_attention", "release", "reserve"]
