"""FX graph passes (GraphModule -> GraphModule) that turn a captured model step into a speculative step."""
