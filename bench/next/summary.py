"""One line per benchmark JSON under a folder: the figures an A/B compares."""

import json
import pathlib
import sys

KEYS = ("decode_ms_per_token", "pct_of_floor", "output_tok_per_s", "ttft_ms")
for path in sorted(pathlib.Path(sys.argv[1]).rglob("*.json")):
    result = json.loads(path.read_text())
    print(path.parent.name, path.stem, {k: result[k] for k in KEYS if k in result})
