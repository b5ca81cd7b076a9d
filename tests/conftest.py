"""Shared test settings. Tests run on CPU; parity references come from HF transformers on PyTorch CPU."""

import os

# Keep XLA from grabbing every core's worth of threads per test process on a 2-core CI machine.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
