"""kvfleet.engine.models: model architectures (torch modules) served by the engine."""
