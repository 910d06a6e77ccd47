"""kvfleet.engine.attention: attention over the paged KV cache, behind one backend interface."""
