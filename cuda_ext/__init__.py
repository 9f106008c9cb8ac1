"""cuda_ext."""
