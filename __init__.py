"""flare: reproducible, signed runtime packages for LLM checkpoints, a content-addressed
registry a lab shares over a NAS, and a server for them."""

__version__ = "0.1.0"
