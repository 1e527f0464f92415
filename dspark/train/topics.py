"""Handwritten topics and request templates for the chat prompts (written for this project).

The topics span everyday life, science, history, technology, arts and work, so the target's
answers cover a broad slice of its vocabulary; the templates vary the answer form (explanation,
list, story, poem, comparison, email) because the drafter must learn the target's style in each.
"""

from __future__ import annotations

TOPICS: tuple[str, ...] = (
    # nature and science
    "volcanoes", "ocean tides", "photosynthesis", "black holes", "the water cycle", "earthquakes",
    "honeybees", "coral reefs", "the immune system", "DNA", "rainbows", "the northern lights",
    "plate tectonics", "climate change", "the solar system", "gravity", "electricity",
    "magnetism", "sound waves", "the human heart", "sleep", "dinosaurs", "evolution",
    "rainforests", "deserts", "glaciers", "migratory birds", "octopuses", "mushrooms",
    "the moon landing", "comets", "vaccines", "antibiotics", "the periodic table", "atoms",
    "renewable energy", "solar panels", "wind turbines", "recycling", "composting",
    # technology and computing
    "the internet", "email", "smartphones", "computer memory", "operating systems",
    "databases", "version control", "unit testing", "recursion", "sorting algorithms",
    "hash tables", "binary numbers", "encryption", "passwords", "open source software",
    "cloud computing", "web browsers", "programming languages", "debugging", "code reviews",
    "regular expressions", "spreadsheets", "3D printing", "robots", "electric cars", "GPS",
    "video games", "social media", "machine learning", "data privacy",
    # history and society
    "the printing press", "ancient Egypt", "the Roman Empire", "the Silk Road", "the Renaissance",
    "the industrial revolution", "the history of writing", "libraries", "museums", "democracy",
    "trade", "money", "banks", "taxes", "maps", "lighthouses", "railways", "the postal service",
    "the Olympic Games", "public transport", "cities", "villages", "volunteering", "elections",
    # daily life, food and health
    "bread baking", "making soup", "coffee", "tea", "breakfast", "cooking rice", "spices",
    "vegetable gardens", "houseplants", "a healthy diet", "drinking water", "running",
    "yoga", "swimming", "cycling", "hiking", "camping", "stretching", "meditation",
    "time management", "saving money", "moving to a new city", "job interviews",
    "learning a new language", "studying for exams", "writing a resume", "public speaking",
    "making friends", "keeping a journal", "cleaning a kitchen", "packing for a trip",
    # arts, culture and hobbies
    "jazz", "classical music", "learning the piano", "painting with watercolors", "photography",
    "poetry", "novels", "fairy tales", "theater", "movies", "chess", "board games",
    "knitting", "woodworking", "origami", "pottery", "dancing", "birdwatching",
    # animals and places
    "cats", "dogs", "horses", "elephants", "penguins", "whales", "owls", "ants",
    "mountains", "islands", "rivers", "lakes", "forests", "the Arctic", "the Sahara",
)

CHAT_TEMPLATES: tuple[str, ...] = (
    "Explain {topic} in simple terms.",
    "What are three interesting facts about {topic}?",
    "Write a short poem about {topic}.",
    "Give me a beginner's guide to {topic}.",
    "What are the pros and cons of {topic}?",
    "Summarize the history of {topic} in one paragraph.",
    "Write a short story that involves {topic}.",
    "How would you explain {topic} to a ten-year-old?",
    "List five questions people often ask about {topic}, each with a brief answer.",
    "What are common misconceptions about {topic}?",
    "Compare {topic} and {other}.",
    "Write a friendly email to a colleague recommending that they learn about {topic}.",
    "Give me three practical tips related to {topic}.",
    "Why is {topic} important?",
    "Write a haiku about {topic}, then explain it.",
    "Describe {topic} in exactly three sentences.",
)

MODULE_TEMPLATES: tuple[str, ...] = (
    "Explain what the Python module `{module}` is for.",
    "The Python standard library module `{module}` is described as: \"{summary}\". "
    "Show a short example of how to use it.",
    "When should I use Python's `{module}` module? Give one example.",
)

CODE_CHAT_TEMPLATES: tuple[str, ...] = (
    "Write a Python function `{signature}` that does the following: {summary}.",
    "Implement `{name}` in Python. It should {summary}.",
    "Complete this Python function:\n\n```python\n{header}\n```",
    "Write Python code for a function that will {summary}. Use the signature `{signature}`.",
    "Explain what this Python function is supposed to do, then implement it:\n\n"
    "```python\n{header}\n```",
)
