"""GPU kernels for hot paths (Triton), each with a pure-torch reference that is the CPU path."""
