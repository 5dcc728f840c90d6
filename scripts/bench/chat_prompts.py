#!/usr/bin/env python3
"""Templated chat prompts as token ids, for engine examples that take prompts.json.

    python scripts/bench/chat_prompts.py <model or tokenizer dir> <out.json>
"""
import json
import sys

from transformers import AutoTokenizer

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Write a short story about a robot who learns to paint.",
    "What are the main causes of the seasons on Earth?",
    "Give me a recipe for pancakes.",
]

tok = AutoTokenizer.from_pretrained(sys.argv[1])
out = []
for q in QUESTIONS:
    ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
    out.append(ids if isinstance(ids, list) else ids["input_ids"])
json.dump(out, open(sys.argv[2], "w"))
