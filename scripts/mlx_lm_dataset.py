"""Prints mlx-lm's (tokens, offset) for every line of the given .jsonl files, as its tuner's
datasets (`mlx_lm/tuner/datasets.py`) process them with the model's tokenizer: the reference
of mlxd's training data test (engine/tests/engine/train.rs). Prompt masking is on except for
files named `text.jsonl` (mlx-lm refuses it for text data).

    python scripts/mlx_lm_dataset.py <model dir> <file.jsonl>...
"""

import json, sys
from transformers import AutoTokenizer
from mlx_lm.tuner.datasets import create_dataset
import types
tok = AutoTokenizer.from_pretrained(sys.argv[1])
out = []
for path in sys.argv[2:]:
    rows = [json.loads(l) for l in open(path)]
    ds = create_dataset(rows, tok, types.SimpleNamespace(mask_prompt=not path.endswith("text.jsonl")))
    out.append([list(ds.process(ds[i])) for i in range(len(ds))])
print(json.dumps(out))
