"""KV as data: formats and page layouts (`KVFormat`, `KVPages`), the page pool, allocator and
prefix cache, token tiers, stored forms, and the KV cache manager, the only writer of device
KV state. Imports nothing of jkv but `jkv.config`."""
