"""Shipped Hugging Face-style ``config.json`` files for the capacity planner (no weights).

Each file holds only the architecture fields the planner reads, written from the model's public
card / config; ``_source`` names the model. Load them with :func:`hybrid_alloc.planner.load_config`.
"""
