"""kvfleet.gateway: the OpenAI-compatible front door (queue, rate limits, prefix-aware routing).

NOTE: never import torch here or below: the gateway image does not have it.
"""
