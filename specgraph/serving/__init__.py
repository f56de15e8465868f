"""Serving: continuous batching on the compiled engine (:mod:`specgraph.serving.engine`), the
load-aware depth policy (:mod:`specgraph.serving.depth`) and the OpenAI-compatible HTTP server
(:mod:`specgraph.serving.server`; needs the ``serve`` extra: FastAPI, uvicorn, prometheus_client)."""
from specgraph.serving.depth import LoadAwareDepth, measure_costs
from specgraph.serving.engine import (EngineStopped, Event, Handle, QueueFull, ServeRequest, ServingEngine,
                                      serving_support)

__all__ = ["ServingEngine", "ServeRequest", "Event", "Handle", "QueueFull", "EngineStopped", "LoadAwareDepth",
           "measure_costs", "serving_support"]
