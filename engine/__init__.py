"""kvfleet.engine: the paged, continuously batched LLM engine and its OpenAI server.

NOTE: keep this file free of imports. The `kvfleet` command lives in this package and runs in the
gateway and operator images, which have no torch.
"""
