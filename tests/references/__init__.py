"""Pure-torch references that the tests hold kernels against; not shipped."""
