"""The Serve application builder: ``import_path: deployments.app:app_builder`` in app.yaml."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from deployments.app_args import AppArgs
from deployments.router import Router

CONTROL_REQUEST_HEADROOM = 16  # /health, /metrics and /debug requests beyond the generation capacity


def app_builder(args: dict[str, Any]) -> Application:
    app_args = AppArgs.model_validate(args)
    return Router.options(  # type: ignore[attr-defined]  # a Serve Deployment
        ray_actor_options=app_args.router_resources.actor_options(),
        placement_group_bundles=app_args.placement_bundles(),
        placement_group_strategy=app_args.placement_strategy.value,
        # above the router's own limit, so that a full queue is answered with a 429 instead of waiting in the proxy
        max_ongoing_requests=app_args.capacity + CONTROL_REQUEST_HEADROOM,
        # and a bounded wait in the proxy beyond that (slow bodies, /debug calls filling the headroom): Serve's
        # own 503 rather than a queue without end in front of /health
        max_queued_requests=app_args.capacity + CONTROL_REQUEST_HEADROOM,
    ).bind(app_args)
