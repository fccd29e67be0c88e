"""The replicas' one persistent KV tier: with a store (`--store-dir` or `--store-spec`) and
more than one replica, every replica writes the same OCDBT database through one coordinator
(`StoreConfig.store_coordinator`), which the cluster's driver starts here unless one is given.
A replica's host tier stays its own; what one writes to the shared tier the others find
(`jkv.store.adoption`)."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("jkv.cluster")


def share_store(llm_options: dict, replicas: int, host: str = "127.0.0.1"
                ) -> tuple[dict, Any | None]:
    """`llm_options` with the store shared by the replicas (its directory made absolute: a
    replica's working directory is Ray's), and the coordinator server started for it (keep
    it alive while the replicas run; None when none was needed or one was given)."""
    options = dict(llm_options)
    if options.get("store_dir") is not None:
        options["store_dir"] = os.path.abspath(os.path.expanduser(options["store_dir"]))
    persistent = options.get("store_dir") or options.get("store_spec")
    if persistent is None or replicas < 2 or options.get("store_coordinator"):
        return options, None
    import tensorstore as ts

    server = ts.ocdbt.DistributedCoordinatorServer({"bind_addresses": [f"{host}:0"]})
    options["store_coordinator"] = f"{host}:{server.port}"
    log.info("the replicas share the KV store at %s through the coordinator at %s",
             persistent, options["store_coordinator"])
    return options, server
