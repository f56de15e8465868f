raise ImportError("chain Triton kernel not written yet")
