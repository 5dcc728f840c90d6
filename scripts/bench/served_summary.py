"""One line per serve.py output file: each label's output tok/s (every timed round, warm-up
rounds left out), and where the file has a `base` label, each other label's mean over the
base's (issue 25's four adapters against the base alone).

    python3 scripts/bench/served_summary.py <serve.py jsonl>...
"""

import json
import sys
from collections import defaultdict
from statistics import mean


def summary(path: str) -> dict:
    rates = defaultdict(list)
    failures = 0
    with open(path) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            failures += row.get("failures", 0)
            if row["label"].endswith("warm") or row["label"] == "warm":
                continue
            rates[row["label"]].append(row["output_tok_s"])
    out = {"file": path, "failures": failures}
    out.update({label: [round(r) for r in values] for label, values in rates.items()})
    if "base" in rates:
        base = mean(rates["base"])
        for label, values in rates.items():
            if label != "base":
                out[f"{label}/base"] = round(mean(values) / base, 3)
    return out


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in sys.argv[1:]:
        print(json.dumps(summary(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
