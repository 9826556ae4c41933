"""Scale-out on Ray Serve (the ``cluster`` extra: ``ray[serve]``): many engine replicas
behind one OpenAI endpoint, each conversation routed to the replica that holds its prefix.

Two tiers, as Ray Serve LLM's: an ingress deployment with ``engine serve``'s own app, and
engine replica deployments behind it, called through a deployment handle so that Serve's
request routers apply (``routing``: ``prefix``, ``session``, ``pow2``). ``python -m engine
cluster`` runs it; :func:`build_app` builds the Serve application, :func:`app_builder` is
``serve deploy``'s entry point.
"""

from __future__ import annotations

from .deployments import ClusterConfig, app_builder, build_app
from .routing import ROUTERS

__all__ = ["ROUTERS", "ClusterConfig", "app_builder", "build_app"]
