"""KV techniques as policies, one module each, registered by name.

Every module here that defines `POLICY` (a `registry.KVPolicy`) is found at import: adding a
technique is adding its module. `POLICIES` maps each name to its policy, "none" first.
"""

from __future__ import annotations

import importlib
import pkgutil

from jkv.policies.registry import KVPolicy


def _discover() -> dict[str, KVPolicy]:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        policy = getattr(importlib.import_module(f"{__name__}.{info.name}"), "POLICY", None)
        if isinstance(policy, KVPolicy):
            if policy.name in found:
                raise RuntimeError(f"two policies named {policy.name!r}")
            found[policy.name] = policy
    return dict(sorted(found.items(), key=lambda kv: (kv[0] != "none", kv[0])))


POLICIES: dict[str, KVPolicy] = _discover()


def register(policy: KVPolicy) -> None:
    """Add a policy defined outside this package (research code): `kv_policy=policy.name`
    then selects it in this process. ValueError if the name is taken."""
    if policy.name in POLICIES:
        raise ValueError(f"a kv_policy named {policy.name!r} exists already")
    POLICIES[policy.name] = policy


def policy_help() -> str:
    """`kv_policy`'s help: every policy's summary and the settings it reads."""
    return "; ".join(
        f"{p.name} = {p.summary}" + (f" ({', '.join(f'`{k}`' for k in p.knobs)})"
                                     if p.knobs else "")
        for p in POLICIES.values())


__all__ = ["POLICIES", "KVPolicy", "policy_help", "register"]
