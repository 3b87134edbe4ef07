"""Every strategy's options: argument checks and which pairs compose (no TensorFlow)."""
