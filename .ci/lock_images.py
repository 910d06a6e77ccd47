"""An image's requirements.lock from a `pip install --dry-run --report` file (`make locks`)."""

import json
import sys

SKIPPED = {"kvfleet", "torch", "triton"}  # the package itself; torch comes from its own index

report, image = sys.argv[1], sys.argv[2]
with open(report) as handle:
    installs = json.load(handle)["install"]
pins = sorted(
    f"{item['metadata']['name']}=={item['metadata']['version']}"
    for item in installs
    if item["metadata"]["name"].lower() not in SKIPPED
)
