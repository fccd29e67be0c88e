"""Device-side KV state: the page pool, who holds which page, attention over them, and the
manager and connector that own them for an engine."""

from jkv.cache.allocator import FreeList, PageTables, init_free, init_tables, release, reserve
from jkv.cache.attention import paged_attention
from jkv.cache.kv_write import Window, append_kv
from jkv.cache.layer_kv import LayerKV, LayerTiers, attend
from jkv.cache.page_pool import FillingPages, init_filling, page_bytes
from jkv.pallas_kernels.kv_pages import KVPages

__all__ = ["FillingPages", "FreeList", "KVPages", "LayerKV", "LayerTiers", "PageTables",
           "Window", "append_kv", "attend", "init_filling", "init_free", "init_tables",
           "page_bytes", "paged_attention", "release", "reserve"]
