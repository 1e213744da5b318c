"""One module per speculative algorithm (each registers itself with `register_algorithm`)."""
