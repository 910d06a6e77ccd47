"""kvfleet.engine.core: scheduling and KV-cache bookkeeping; pure Python, no torch, no I/O."""
