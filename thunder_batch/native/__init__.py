"""Native CPU kernels the compiled step can use (built on first use, see `build`)."""
