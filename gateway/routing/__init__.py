"""kvfleet.gateway.routing: where a request goes; pure Python over snapshots, no I/O, no clock."""
