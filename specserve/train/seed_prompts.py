"""Prompt seeds for self-distillation, built offline: templates over topic lists plus passages of the
Python standard library's own documentation (``pydoc_data`` help topics and module docstrings).

Never the MT-bench questions (they are the evaluation set): these prompts are written from scratch here, and
``tests/test_train.py`` checks that none of them appears in the benchmark file.
"""

from __future__ import annotations

import importlib
import random
import re

TOPICS = [
    "the water cycle",
    "volcanoes",
    "black holes",
    "photosynthesis",
    "the Roman Empire",
    "the printing press",
    "electric cars",
    "honey bees",
    "the human heart",
    "machine learning",
    "climate change",
    "the stock market",
    "jazz music",
    "the Silk Road",
    "vaccines",
    "plate tectonics",
    "the Renaissance",
    "coral reefs",
    "solar panels",
    "the French Revolution",
    "bread baking",
    "chess openings",
    "the immune system",
    "quantum computing",
    "the Moon landing",
    "recycling",
    "mountain climbing",
    "ancient Egypt",
    "rainforests",
    "the internet",
    "earthquakes",
    "supply and demand",
    "the Olympic Games",
    "dinosaurs",
    "tea ceremonies",
    "public libraries",
    "the periodic table",
    "wind turbines",
    "migratory birds",
    "the Great Wall of China",
    "sleep",
    "inflation",
    "origami",
    "the Industrial Revolution",
    "octopuses",
    "glaciers",
    "democracy",
    "coffee",
    "antibiotics",
    "the speed of light",
    "marathon training",
    "urban gardening",
    "bridges",
    "the Pythagorean theorem",
    "Shakespeare's plays",
    "compound interest",
    "telescopes",
    "deserts",
    "remote work",
    "friendship",
    "public speaking",
    "time management",
    "a small bakery",
    "a lighthouse keeper",
    "a robot learning to paint",
    "a lost dog",
    "a space station",
    "a mountain village",
    "a detective",
    "a dragon who is afraid of fire",
    "a time traveller",
    "a chess tournament",
    "a rainy city",
    "a pirate ship",
]

PEOPLE = [
    "a pirate captain",
    "a medieval knight",
    "a tour guide in Rome",
    "a friendly robot",
    "a detective",
    "a chef in a busy kitchen",
    "a astronaut on Mars",
    "a wise old wizard",
    "a sports commentator",
    "a museum curator",
    "a science teacher",
    "a travel blogger",
    "a customer support agent",
    "a poet",
]

TEMPLATES = {
    "writing": [
        "Write a short story about {topic}.",
        "Write a poem about {topic}.",
        "Write a persuasive paragraph about why people should learn about {topic}.",
        "Write a blog post introduction about {topic}.",
        "Write an email to a friend describing {topic}.",
        "Write a haiku about {topic}.",
        "Write a product description for something related to {topic}.",
        "Compose a short speech about {topic} for a school assembly.",
    ],
    "roleplay": [
        "Pretend you are {person}. Tell me about {topic}.",
        "You are {person}. Greet a visitor and explain your day.",
        "Act as {person} and give advice to a beginner about {topic}.",
        "Imagine you are {person}. Describe {topic} in your own words.",
    ],
    "explain": [
        "Explain {topic} to a ten year old.",
        "What is {topic}? Give a clear explanation.",
        "Describe the history of {topic} in a few paragraphs.",
        "What are the advantages and disadvantages of {topic}?",
        "Give me five interesting facts about {topic}.",
        "Summarize the most important ideas about {topic}.",
        "How does {topic} work?",
        "Compare {topic} and {topic2}.",
        "List three common misconceptions about {topic} and correct them.",
    ],
    "reasoning": [
        "If {a} people each bring {b} apples and {c} apples are eaten, how many apples are left? Explain.",
        "A train travels {a} kilometres in {b} hours. What is its average speed? Show your reasoning.",
        "Tom is {a} years old. His sister is {b} years older. How old will she be in {c} years?",
        "There are {a} red balls and {b} blue balls in a bag. What is the probability of drawing a red ball?",
        "Is the number {n} prime? Explain step by step.",
        "Sort these numbers from smallest to largest and explain how: {a}, {n}, {b}, {c}.",
    ],
    "math": [
        "What is {a} times {b}? Show the steps.",
        "Solve for x: {a}x + {b} = {c}.",
        "Compute the sum of the integers from 1 to {n}.",
        "What is {a}% of {n}?",
        "Find the area of a rectangle with sides {a} and {b}.",
        "Simplify the fraction {a}/{c}.",
        "What is the derivative of x^{b} + {a}x?",
    ],
    "coding": [
        "Write a {lang} function that {task}.",
        "Write a {lang} function that {task}, {style}.",
        "Explain what this Python code does:\n\n{code}",
        "How can I write code that {task} in {lang}? Give an example.",
        "Write a SQL query that {sql}.",
        "Find the bug in this code and fix it:\n\n{code}",
        "What is the time complexity of a function that {task}? Explain.",
    ],
    "extraction": [
        "Summarize the following text in two sentences:\n\n{passage}",
        "Extract the key terms from the following text and explain each briefly:\n\n{passage}",
        "Rewrite the following text in simpler words:\n\n{passage}",
        "Write three questions a student could answer after reading this:\n\n{passage}",
        "What is the main idea of this passage?\n\n{passage}",
    ],
}

TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the vowels in a string",
    "finds the largest element of a list",
    "removes duplicates from a list",
    "sorts a list of dictionaries by a key",
    "merges two sorted lists",
    "computes the factorial of a number",
    "checks whether a string is a palindrome",
    "flattens a nested list",
    "counts word frequencies in a text",
    "converts Celsius to Fahrenheit",
    "computes the greatest common divisor of two numbers",
    "reads a CSV file and prints each row",
    "finds the second smallest number in a list",
    "validates an email address",
    "returns the intersection of two lists",
    "implements binary search",
    "rotates a matrix by 90 degrees",
    "parses a date string",
    "generates all permutations of a list",
]

LANGS = ["Python", "JavaScript", "C", "Java", "Go", "Rust", "C++", "TypeScript", "Bash", "Ruby"]
STYLES = [
    "with comments",
    "and add a few tests",
    "without using libraries",
    "as efficiently as possible",
    "and explain each step",
    "with type hints",
    "using recursion",
    "using a loop",
]

SQL = [
    "selects all customers from London",
    "counts orders per customer",
    "finds the five most expensive products",
    "joins employees with their departments",
    "computes the average salary per department",
    "deletes rows older than one year",
    "finds duplicate email addresses",
]

CODE = [
    "def f(xs):\n    return [x * 2 for x in xs if x % 2 == 0]",
    "total = 0\nfor i in range(10):\n    total += i\nprint(total)",
    "def add(a, b):\n    return a - b",
    "def mean(xs):\n    return sum(xs) / len(xs) + 1",
    "words = text.split()\ncounts = {}\nfor w in words:\n    counts[w] = counts.get(w, 0) + 1",
    "def last(xs):\n    return xs[len(xs)]",
    "import json\nwith open('data.json') as f:\n    data = json.load(f)\nprint(data['name'])",
]

DOC_MODULES = [
    "json",
    "csv",
    "re",
    "os",
    "pathlib",
    "collections",
    "itertools",
    "functools",
    "heapq",
    "bisect",
    "random",
    "statistics",
    "datetime",
    "calendar",
    "textwrap",
    "string",
    "struct",
    "hashlib",
    "zipfile",
    "tarfile",
    "logging",
    "argparse",
    "unittest",
    "doctest",
    "sqlite3",
    "http.server",
    "urllib.parse",
    "email",
    "decimal",
    "fractions",
    "math",
    "cmath",
    "array",
    "queue",
    "threading",
    "subprocess",
    "shutil",
    "glob",
    "tempfile",
    "pickle",
    "copy",
    "pprint",
    "enum",
    "dataclasses",
    "typing",
    "abc",
    "contextlib",
    "inspect",
]


def doc_passages(max_chars: int = 900) -> list[str]:
    """Paragraph-sized passages from the standard library's help topics and module docstrings."""
    texts: list[str] = []
    try:
        from pydoc_data.topics import topics  # type: ignore[import-not-found]

        texts += [topics[k] for k in sorted(topics)]
    except ImportError:  # a Python built without its docs data
        pass
    for name in DOC_MODULES:
        try:
            doc = importlib.import_module(name).__doc__
        except ImportError:
            continue
        if doc:
            texts.append(doc)
    passages = []
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if 200 <= len(para) <= max_chars and not para.startswith((">>>", "...")):
                passages.append(para)
    return passages


def seed_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts, categories drawn uniformly, deterministic for a seed."""
    rng = random.Random(seed)
    passages = doc_passages()
    categories = sorted(TEMPLATES)
    out: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n and attempts < 50 * n:
        attempts += 1
        cat = rng.choice(categories)
        template = rng.choice(TEMPLATES[cat])
        a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(1, 30)
        prompt = template.format(
            topic=rng.choice(TOPICS),
            topic2=rng.choice(TOPICS),
            person=rng.choice(PEOPLE),
            a=a,
            b=b,
            c=c,
            n=rng.randint(10, 500),
            task=rng.choice(TASKS),
            lang=rng.choice(LANGS),
            style=rng.choice(STYLES),
            sql=rng.choice(SQL),
            code=rng.choice(CODE),
            passage=rng.choice(passages) if passages else rng.choice(TOPICS),
        )
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    return out


SKIP_MODULES = (
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "__main__",
    "pydoc_data",
    "lib2to3",
)


def docstring_passages(min_chars: int = 150, max_chars: int = 3000) -> list[tuple[str, str]]:
    """(name, text) of standard-library modules, their public classes, functions and methods, and the help
    topics: offline English text about code, answered "in the target's voice" by teacher forcing
    (``distill.build_text_dataset``)."""
    import inspect
    import sys
    import warnings

    out: list[tuple[str, str]] = []
    for mod_name in sorted(sys.stdlib_module_names):
        if mod_name.startswith("_") or mod_name.startswith(SKIP_MODULES):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(mod_name)
        except Exception:  # platform-specific or optional modules
            continue
        objects = [(mod_name, mod)] + [
            (f"{mod_name}.{k}", v)
            for k, v in sorted(vars(mod).items())
            if not k.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v)) and v.__module__ == mod_name
        ]
        objects += [
            (f"{name}.{k}", v)
            for name, cls in list(objects[1:])
            if inspect.isclass(cls)
            for k, v in sorted(vars(cls).items())
            if not k.startswith("_") and inspect.isfunction(v)
        ]
        for name, obj in objects:
            doc = inspect.getdoc(obj)
            if doc and min_chars <= len(doc) <= max_chars:
                out.append((name, doc))
    try:
        from pydoc_data.topics import topics  # type: ignore[import-not-found]
    except ImportError:
        return out
    for key in sorted(topics):
        text = topics[key]
        for i in range(0, len(text), max_chars):
            if len(text[i : i + max_chars]) >= min_chars:
                out.append((f"the Python topic '{key}'", text[i : i + max_chars]))
    return out


def text_passages(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (prompt, answer text) pairs for teacher-forced features, deterministic for a seed."""
    pairs = docstring_passages()
    rng = random.Random(seed)
    rng.shuffle(pairs)
    asks = ["Explain {name}.", "What does {name} do?", "Describe {name} in Python.", "How do I use {name}?"]
    return [(rng.choice(asks).format(name=name), doc) for name, doc in pairs[:n]]
