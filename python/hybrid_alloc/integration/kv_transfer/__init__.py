"""KV transfer: blocks that leave the GPU pools and come back (both sides of each).

* :mod:`.offload`: vLLM's native KV offloading with per-group pools, and on CPU platforms;
* :mod:`.offload_tiers`: secondary offload tiers and the layout their files are written in;
* :mod:`.nixl`: vLLM's NixlConnector (prefill/decode disaggregation) on per-group pools.
"""
