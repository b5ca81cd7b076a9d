"""KV cache: host-side page bookkeeping (no jax) and the device page pools."""
