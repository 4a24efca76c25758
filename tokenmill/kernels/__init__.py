"""Native kernels: C++ sources compiled on first use for the machine they run on."""
