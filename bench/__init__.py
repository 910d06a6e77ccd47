"""kvfleet.bench: benchmarks (`kvfleet bench ...`); they measure, tests check. See README.md."""
