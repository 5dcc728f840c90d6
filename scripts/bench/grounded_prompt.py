#!/usr/bin/env python3
"""The input-grounded task of the speculative-decoding benchmark, as prompt token ids.

    python scripts/bench/grounded_prompt.py <model or tokenizer dir> <out.json> [--tokens 1000]

A chat-templated request to copy a given text of about `--tokens` tokens, correcting its
spelling: what editing and summarising requests look like, where most of the answer repeats
the input (prompt lookup's case). The text is English prose from the Python standard library's
own documentation (module docstrings), so it is the same on every machine.
"""
import argparse
import json

import argparse as _a, json as _j, textwrap, logging, unittest, collections, csv, pathlib as _p
from transformers import AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=1000)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    paragraphs = []
    for module in (_a, _j, logging, unittest, csv, collections, textwrap, _p):
        for para in (module.__doc__ or "").split("\n\n"):
            words = " ".join(para.split())
            if len(words.split()) >= 12 and not words.startswith((">>>", "$")):
                paragraphs.append(words)
    text, n = [], 0
    for para in paragraphs:
        if n >= args.tokens:
            break
        text.append(para)
        n += len(tok.encode(para, add_special_tokens=False))
    request = ("Copy the following text exactly, paragraph by paragraph, correcting only "
               "spelling mistakes if there are any:\n\n" + "\n\n".join(text))
    ids = tok.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    json.dump(ids, open(args.out, "w"))
    print(json.dumps({"prompt_tokens": len(ids), "text_tokens": n}))


if __name__ == "__main__":
    main()
