"""The engine: sequences, paged KV blocks, scheduling, sampling and the step loop.

Nothing here names a model family: a model is anything with the `CausalLM` interface of
`runner.py`, and attention goes through the backend interface of `attention.py`.
"""
