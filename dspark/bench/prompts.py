"""Fixed benchmark and demo prompts: a mix of chat-like and code-like requests."""

CHAT = [
    "Explain why the sky is blue in a few sentences.",
    "Write a short story about a robot learning to paint.",
    "What are the main differences between a list and a tuple in Python?",
    "Give me three tips for staying focused while studying.",
    "Describe how a refrigerator keeps food cold.",
    "Summarize the plot of a heist movie you would like to see.",
    "What should I pack for a weekend hiking trip?",
    "Why do leaves change color in autumn?",
]

CODE = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "# Python function that checks whether a string is a palindrome\ndef is_palindrome(s):\n",
    "class Stack:\n    \"\"\"A simple LIFO stack.\"\"\"\n\n    def __init__(self):\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return a dict.\"\"\"\n",
    "def binary_search(items, target):\n",
    "# Sort a list of dictionaries by the 'age' key\npeople = [{'name': 'a', 'age': 3}]\n",
    "def merge_sort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "def count_words(text):\n    \"\"\"Count how often each word occurs.\"\"\"\n",
]


def bench_prompts(n: int) -> list[str]:
    pool = [p for pair in zip(CHAT, CODE) for p in pair]
    return [pool[i % len(pool)] for i in range(n)]


def file_prompts(data: str | None, tokenizer, limit: int) -> dict[str, list[list[int]]] | None:
    """`--data ood` (the shipped out-of-distribution set, docs/training_data.md) or a .jsonl of
    {"kind", "text"} lines: {"chat", "code": [prompt ids]}, chat kinds through the chat template,
    `code_raw` as is. None when `data` is a training-data folder."""
    import json
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "ood_prompts.jsonl") \
        if data == "ood" else data
    if path is None or not path.endswith(".jsonl"):
        return None
    out: dict[str, list[list[int]]] = {"chat": [], "code": []}
    with open(path) as f:
        for row in map(json.loads, filter(str.strip, f)):
            kind = "chat" if row["kind"] == "chat" else "code"
            if len(out[kind]) >= limit:
                continue
            if row["kind"] == "code_raw":
                out[kind].append(tokenizer.encode(row["text"]))
            else:
                text = tokenizer.apply_chat_template([{"role": "user", "content": row["text"]}])
                out[kind].append(tokenizer.encode(text, add_special_tokens=False))
    return out
