"""End-to-end demo: the Rust block pool inside a real vLLM engine on a tiny hybrid model.

* :mod:`~hybrid_alloc.demo.tiny_model` writes a tiny random-weight hybrid model (no
  download);
* :mod:`~hybrid_alloc.demo.engine_run` runs one engine on a fixed workload and writes JSON;
* :mod:`~hybrid_alloc.demo.probe` is the scheduler subclass that reports, from the
  engine-core process, which block pool vLLM built;
* ``python -m hybrid_alloc.demo`` runs both backends and compares them.

Nothing here imports vLLM at import time except :mod:`~hybrid_alloc.demo.probe`.
"""
