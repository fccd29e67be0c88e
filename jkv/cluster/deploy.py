"""The jkv cluster as a Ray Serve application: an ingress (`ingress.build_ingress`) in front
of `replicas` copies of `Replica`, each request routed by the chosen request router.

Routers: "kv" (`router.KVAwareRouter`: session, then longest held prefix, within a queue
bound), "pow2" (Serve's default, `PowerOfTwoChoicesRequestRouter`) and "prefix" (Ray's
`PrefixCacheAffinityRouter`, which reads the request's prompt or messages; its home in Ray
is internal: the public import path needs Ray's LLM extra).
"""

from __future__ import annotations

import os

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from jkv.cluster.asgi import RoutedRequest
from jkv.cluster.ingress import Hasher, build_ingress
from jkv.cluster.replica import Replica

ROUTERS = {
    "kv": "jkv.cluster.router:KVAwareRouter",
    "pow2": "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter",
    "prefix": ("ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
               "PrefixCacheAffinityRouter"),
}
APP = "jkv"


class Ingress:
    """The ingress deployment: forwards to the replicas' handle (Serve passes it in)."""

    def __init__(self, replicas) -> None:
        self.replicas, self._hasher = replicas, None

    async def hasher(self) -> Hasher:
        if self._hasher is None:
            self._hasher = Hasher(await self.replicas.info.remote(RoutedRequest("GET", "/")))
        return self._hasher

    def __serve_build_asgi_app__(self):
        return build_ingress(self.replicas, self.hasher)


def application(llm_options: dict, app_options: dict, *, replicas: int = 2,
                router: str = "kv", bound: int = 4, replica_cpus: float = 0.5,
                max_ongoing_requests: int = 64, stats_period_s: float = 1.0):
    """The bound Serve application: `replicas` replicas of an LLM made with `llm_options`,
    serving `build_app(**app_options)`, behind the ingress, routed by `router`."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {sorted(ROUTERS)}, got {router!r}")
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    config = RequestRouterConfig(request_router_class=ROUTERS[router],
                                 request_router_kwargs={"bound": bound} if router == "kv"
                                 else {}, request_routing_stats_period_s=stats_period_s)
    replica = serve.deployment(Replica, name="jkv_replica", num_replicas=replicas,
                               max_ongoing_requests=max_ongoing_requests,
                               ray_actor_options={"num_cpus": replica_cpus},
                               request_router_config=config)
    ingress = serve.deployment(serve.ingress()(Ingress), name="jkv_ingress",
                               max_ongoing_requests=max_ongoing_requests * replicas,
                               ray_actor_options={"num_cpus": 0.1})
    return ingress.bind(replica.bind(llm_options, app_options))


def start(app, host: str = "127.0.0.1", port: int = 8000, num_cpus: int | None = None) -> None:
    """Serve `app` on host:port: on the Ray cluster at RAY_ADDRESS, else a local one
    started here (no dashboard, a small object store)."""
    if not ray.is_initialized() and os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    elif not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 object_store_memory=256 << 20)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP, route_prefix="/", blocking=False)


def node_address() -> str:
    """This machine's address as the Ray cluster's other nodes reach it."""
    return ray.util.get_node_ip_address()


def stop() -> None:
    """Take the application down and leave Ray (a local instance stops with it)."""
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


__all__ = ["APP", "ROUTERS", "Ingress", "application", "node_address", "start", "stop"]
