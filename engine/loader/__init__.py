"""kvfleet.engine.loader: find a model, read its config, and fill a model's weights."""
