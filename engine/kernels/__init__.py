"""Pure compute on tensors and views. Kernels know no region, cache or policy."""
