"""kvfleet.gateway.admission: keys, rate limits, the fair queue; pure Python, `now` passed in."""
