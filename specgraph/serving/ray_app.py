"""Scale-out on Ray Serve: N replicas of the server (each its own process, engine and graph set)
behind Ray's HTTP proxy and router. ``specgraph serve MODEL --ray-replicas N`` runs
:func:`run_replicas`; :func:`build_app` is the Ray Serve application for ``serve.run`` in your own
program::

    from ray import serve
    from specgraph.serving.launch import ServeConfig
    from specgraph.serving.ray_app import build_app

    serve.run(build_app(ServeConfig(model="default"), replicas=2), route_prefix="/")

Every replica builds (or loads, from the shared graph cache) its graphs in its constructor, before
Ray routes a request to it. Ray's router balances requests across replicas; within a replica,
the engine batches them continuously.
"""
from __future__ import annotations

import dataclasses
import time

from specgraph.serving.launch import ServeConfig


class SpecgraphReplica:
    """One replica: the FastAPI app of :func:`specgraph.serving.launch.build_server`, built when
    Ray starts the replica."""

    def __init__(self, cfg: dict):
        self.cfg = ServeConfig(**cfg)

    def __serve_build_asgi_app__(self):
        from specgraph.serving.launch import build_server

        app, engine, _ = build_server(self.cfg)
        engine.start()  # also started by the app's lifespan; starting twice is a no-op
        return app


def deployment(replicas: int, cpus_per_replica: float | None = None):
    """The Ray Serve deployment class (not bound to a config)."""
    from ray import serve

    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    options = {"num_replicas": replicas, "max_ongoing_requests": 1024}
    if cpus_per_replica is not None:
        options["ray_actor_options"] = {"num_cpus": cpus_per_replica}
    return serve.deployment(serve.ingress()(SpecgraphReplica), name="specgraph", **options)


def build_app(cfg: ServeConfig, replicas: int = 1, cpus_per_replica: float | None = None):
    """The application to pass to ``ray.serve.run``: ``replicas`` copies of the server."""
    return deployment(replicas, cpus_per_replica).bind(dataclasses.asdict(cfg))


def run_replicas(cfg: ServeConfig, replicas: int, host: str = "127.0.0.1", port: int = 8000) -> int:
    """Start Ray (locally), serve ``replicas`` replicas on host:port until interrupted."""
    import ray
    from ray import serve

    ray.init(include_dashboard=False, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(cfg, replicas, cpus_per_replica=0), route_prefix="/", name="specgraph")
    print(f"specgraph serve: {replicas} replicas on http://{host}:{port}/v1 (Ray Serve)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0
