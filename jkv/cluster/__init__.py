"""jkv past one machine: replicas of the engine behind a KV-aware router (Ray Serve)."""
