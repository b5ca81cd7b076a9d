"""jaxinfer: a JAX/XLA LLM inference engine."""
