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
