"""Prompt seeds over a dictionary's whole vocabulary: task templates (writing, role-play, explanation, reasoning,
maths, coding, extraction, word use) filled with the nouns of WordNet (the Debian package ``wordnet-base``:
``/usr/share/wordnet``) that occur in its sense-tagged corpus, with their glosses.

The templated seeds of ``seed_prompts`` draw on ~75 topics; a head trained on them agrees with the target far
more often on prompts like them than on real chat traffic (docs/benchmarks.md, "EAGLE-3 head"). These draw on
thousands of concepts, people and places, so the target's answers cover a chat-like vocabulary. Never the
MT-bench questions: prompts sharing an 8-word run with an MT-bench turn are dropped, and the templates are
written here from scratch.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from specserve.errors import SettingsError, SpecServeError
from specserve.train.self_prompts import mt_bench_runs

WORDNET_DIR = Path("/usr/share/wordnet")

# WordNet lexicographer files of nouns (wndb(5WN), lexnames): which role a noun can play in a template
THINGS = {5: "animal", 6: "artifact", 8: "body", 13: "food", 17: "object", 20: "plant", 27: "substance"}
IDEAS = {4: "act", 7: "attribute", 9: "cognition", 10: "communication", 11: "event", 12: "feeling", 14: "group",
         19: "phenomenon", 21: "possession", 22: "process", 26: "state", 28: "time"}  # fmt: skip
PERSON, LOCATION = 18, 15


@dataclass(frozen=True)
class Noun:
    lemma: str
    gloss: str
    lexfile: int
    count: int  # tagged occurrences in WordNet's semantic concordance


class WordNetMissing(SpecServeError, FileNotFoundError):
    pass


def _tag_counts(path: Path) -> dict[tuple[str, int], int]:
    """(lemma, lexicographer file) -> tagged occurrences of its noun senses (``cntlist.rev``)."""
    counts: dict[tuple[str, int], int] = defaultdict(int)
    for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines()):
        try:
            key, _, cnt = line.split()
            lemma, _, sense = key.partition("%")
            fields = sense.split(":")
            if fields[0] == "1":  # ss_type 1: noun
                counts[(lemma.lower(), int(fields[1]))] += int(cnt)
        except (ValueError, IndexError):
            raise _corrupt(path, i, line) from None
    return counts


def _corrupt(path: Path, index: int, line: str) -> SettingsError:
    return SettingsError(f"{path} line {index + 1} is not in WordNet's format: {line[:80]!r}")


def check_wordnet(wordnet_dir: Path = WORDNET_DIR) -> tuple[Path, Path]:
    """WordNet's noun data and tag counts in ``wordnet_dir`` (WordNetMissing where either is absent)."""
    data, cnt = wordnet_dir / "data.noun", wordnet_dir / "cntlist.rev"
    if not data.is_file() or not cnt.is_file():
        raise WordNetMissing(f"WordNet not found in {wordnet_dir}: install the Debian package wordnet-base")
    return data, cnt


def load_nouns(wordnet_dir: Path = WORDNET_DIR, min_count: int = 2) -> list[Noun]:
    """The nouns (first lemma of each synset) seen at least ``min_count`` times in the tagged corpus."""
    data, cnt = check_wordnet(wordnet_dir)
    counts = _tag_counts(cnt)
    nouns: list[Noun] = []
    for i, line in enumerate(data.read_text(encoding="utf-8", errors="replace").splitlines()):
        if line.startswith(" ") or " | " not in line:
            continue  # the licence header
        head, gloss = line.split(" | ", 1)
        fields = head.split()
        try:
            lexfile, lemma = int(fields[1]), fields[4]
        except (ValueError, IndexError):
            raise _corrupt(data, i, line) from None
        word = lemma.replace("_", " ")
        n = counts.get((lemma.lower(), lexfile), 0)
        if n < min_count or not re.fullmatch(r"[A-Za-z][A-Za-z' -]{2,30}", word):
            continue
        nouns.append(Noun(word, gloss.strip().split(";")[0].strip(), lexfile, n))
    return nouns


NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Daniel",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Isla",
    "Jonas",
    "Kemi",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tariq",
    "Uma",
    "Victor",
    "Wen",
    "Yusuf",
    "Zoe",
]
LANGS = ["Python", "JavaScript", "Java", "C++", "Go", "Rust", "TypeScript", "C#", "Kotlin", "Swift", "SQL"]
CODE_TASKS = [
    "keeps a running average of the numbers it is given",
    "groups a list of {things} by their first letter",
    "finds the {thing} that appears most often in a list",
    "stores an inventory of {things} and their prices in a dictionary and totals it",
    "reads lines from a file and counts how many mention a {thing}",
    "validates that a string looks like a phone number",
    "implements a stack with push, pop and peek",
    "returns the k largest values of an array",
    "checks whether two strings are anagrams",
    "converts a number of seconds into hours, minutes and seconds",
    "splits a list into chunks of a given size",
    "computes the median of a list without sorting it in place",
    "removes all vowels from a sentence",
    "finds the longest common prefix of several words",
    "schedules {things} into time slots without overlaps",
    "parses a simple key=value configuration file",
    "simulates rolling two dice a thousand times and prints the frequencies",
    "represents a {thing} as a class with a constructor and a describe method",
    "merges overlapping intervals",
    "counts the islands in a grid of zeros and ones",
]

TEMPLATES: dict[str, list[str]] = {
    "writing": [
        "Write a short story in which {a_thing} changes someone's life.",
        "Write a poem of three stanzas about {idea}.",
        "Write the opening paragraph of a novel set in {place}.",
        "Draft a friendly email inviting a colleague to a workshop on {idea}.",
        "Write a product review of {a_thing}, with one good point and one bad point.",
        "Write a diary entry from the point of view of {a_person} on an unusual day.",
        "Write a short news report about a festival celebrating {things} in {place}.",
        "Write a dialogue between {a_person} and {a_person2} who disagree about {idea}.",
        "Write a limerick about {a_thing}.",
        "Write an advertisement for a new kind of {thing}.",
        "Write a motivational speech for students about {idea}.",
        "Write a travel guide paragraph about what to see in {place}.",
        "Write a letter to a newspaper editor arguing that {things} deserve more attention.",
        'Rewrite this sentence in a more formal tone: "honestly the {thing} thing was kind of a mess".',
        "Give me five creative titles for a blog post about {idea}.",
    ],
    "roleplay": [
        "You are {a_person}. A visitor asks what your work is like. Answer in character.",
        "Pretend to be {a_person} explaining {idea} to a curious child.",
        "Act as {a_person} and give me three tips about {things}.",
        "You are {a_person} in {place}. Describe your morning.",
        "Imagine you are {a_thing}. Tell me about your day from your point of view.",
        "Play the role of a shop assistant selling {things}. I am a hesitant customer; greet me.",
    ],
    "explain": [
        "What is {a_thing}? Explain it in simple terms.",
        "Explain {idea} and why it matters.",
        'The word "{word}" means {gloss}. Explain this idea with two everyday examples.',
        "What is the difference between {a_thing} and {a_thing2}?",
        "Describe how {things} have changed over the last hundred years.",
        "Give me five facts about {things} that most people do not know.",
        "What role does {idea} play in modern society?",
        "Teach me the basics of {idea} in five bullet points.",
        "How would you explain {idea} to someone who has never heard of it?",
        "What are the pros and cons of living in {place}?",
        "Summarize the history of {place} in one paragraph.",
        "Why do people value {things}? Give several reasons.",
        "Describe the job of {a_person} and the skills it needs.",
    ],
    "reasoning": [
        "{n1} is taller than {n2}, and {n2} is taller than {n3}. Who is the shortest? Explain.",
        "A shop sells {things} for {a} dollars each. {n1} buys {b} and pays with {c} dollars. How much change is due?",
        "If every {thing} in a box is either red or blue, and there are {a} red ones and {b} in total, how many are "
        "blue?",
        "{n1} has {a} {things}. {n2} has {b} more than {n1}. How many do they have together?",
        "A recipe needs {a} grams of {food} for {b} people. How much is needed for {c} people?",
        "Which is heavier, a kilogram of {things} or a kilogram of feathers? Explain your reasoning.",
        "{n1} leaves at {h}:00 and drives for {a} minutes. At what time does {n1} arrive?",
        "If all {things} are {things2} and some {things2} are green, must some {things} be green? Explain.",
    ],
    "math": [
        "Solve {a}x - {b} = {c} for x and check your answer.",
        "What is {a} squared minus {b} squared?",
        "A circle has radius {a}. What are its area and circumference?",
        "Find the next two numbers in the sequence {a}, {s2}, {s3}, {s4}.",
        "Convert {a} kilometres to miles.",
        "What is the mean of {a}, {b} and {c}?",
        "A coin is tossed {small} times. What is the probability of getting heads every time?",
        "Factor the expression x^2 + {p}x + {q}.",
        "What is {a} percent of {c}, and what is {c} increased by {a} percent?",
        "Find the least common multiple of {small} and {small2}.",
    ],
    "coding": [
        "Write a {lang} function that {task}.",
        "Write a {lang} program that {task}. Add comments.",
        "How would you test a function that {task}? Write a few test cases in {lang}.",
        "Explain, step by step, an algorithm that {task}, then give its time complexity.",
    ],
    "extraction": [
        "Here are some definitions:\n{defs}\nWhich of these words names {kind}? Answer with the word only.",
        "Read these definitions and turn them into a table with the columns word and meaning:\n{defs}",
        "From the definitions below, list the words in alphabetical order:\n{defs}",
        "Give a one-sentence summary of each definition below:\n{defs}",
        'Read these definitions and return them as JSON with the keys "word" and "category":\n{defs}',
    ],
    "words": [
        'Use the word "{word}" in three different sentences.',
        'What does the word "{word}" mean, and where does it come from?',
        'Give me some synonyms and related words for "{word}".',
        'Write a riddle whose answer is "{word}".',
    ],
}
WEIGHTS = dict(writing=4, roleplay=2, explain=4, reasoning=2, math=2, coding=2, extraction=2, words=1)
KIND_NAMES = {**THINGS, **IDEAS, PERSON: "person", LOCATION: "location"}


def _article(word: str) -> str:
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


def _plural(word: str) -> str:
    if re.search(r"(s|x|z|ch|sh)$", word):
        return word + "es"
    if re.search(r"[^aeiou]y$", word):
        return word[:-1] + "ies"
    return word + "s"


class _Pools:
    def __init__(self, nouns: list[Noun]) -> None:
        common = [n for n in nouns if n.lemma.islower()]
        self.things = [n for n in common if n.lexfile in THINGS]
        self.foods = [n for n in common if n.lexfile == 13] or self.things
        self.ideas = [n for n in common if n.lexfile in IDEAS]
        self.people = [n for n in common if n.lexfile == PERSON]
        self.places = [n for n in nouns if n.lexfile == LOCATION and n.lemma[0].isupper()]
        self.all = common
        pools = (("things", self.things), ("ideas", self.ideas), ("people", self.people))
        missing = [name for name, pool in pools if not pool] + (["four nouns"] if len(common) < 4 else [])
        if missing:  # (the extraction templates list four definitions)
            raise SettingsError(f"the WordNet files hold no {', '.join(missing)}: are they complete?")
        if not self.places:
            self.places = [Noun("a small town", "", LOCATION, 1)]


def _fill(template: str, rng: random.Random, pools: _Pools) -> str:
    def pick(pool: list[Noun]) -> Noun:
        return pool[rng.randrange(len(pool))]

    thing, thing2, idea, word_noun = pick(pools.things), pick(pools.things), pick(pools.ideas), pick(pools.all)
    person, person2 = pick(pools.people), pick(pools.people)
    a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(61, 400)
    step = rng.randint(2, 9)
    entries = rng.sample(pools.all, 4)
    kind_of = rng.choice(entries)
    names = rng.sample(NAMES, 3)
    values = {
        "a_thing": _article(thing.lemma),
        "a_thing2": _article(thing2.lemma),
        "thing": thing.lemma,
        "things": _plural(thing.lemma),
        "things2": _plural(thing2.lemma),
        "food": pick(pools.foods).lemma,
        "idea": idea.lemma,
        "word": word_noun.lemma,
        "gloss": word_noun.gloss,
        "a_person": _article(person.lemma),
        "a_person2": _article(person2.lemma),
        "place": pick(pools.places).lemma,
        "n1": names[0],
        "n2": names[1],
        "n3": names[2],
        "a": a,
        "b": b,
        "c": c,
        "h": rng.randint(6, 20),
        "s2": a + step,
        "s3": a + 2 * step,
        "s4": a + 3 * step,
        "small": rng.randint(2, 12),
        "small2": rng.randint(2, 12),
        "p": rng.randint(2, 12),
        "q": rng.randint(1, 30),
        "lang": rng.choice(LANGS),
        "task": rng.choice(CODE_TASKS).format(thing=thing.lemma, things=_plural(thing.lemma)),
        "defs": "\n".join(f"- {e.lemma}: {e.gloss}" for e in entries),
        "kind": _article(KIND_NAMES.get(kind_of.lexfile, "thing")),
    }
    return template.format(**values)


def lexicon_prompts(n: int, seed: int = 0, wordnet_dir: Path = WORDNET_DIR) -> list[str]:
    """``n`` distinct prompts, deterministic for (``seed``, the WordNet files); none shares an 8-word run with
    MT-bench or holds a shorter turn whole."""
    pools = _Pools(load_nouns(wordnet_dir))
    rng = random.Random(seed)
    banned = mt_bench_runs()
    kinds = list(WEIGHTS)
    weights = [WEIGHTS[k] for k in kinds]
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 20 * n + 100:
            raise SettingsError(f"could not draw {n} distinct prompts from WordNet in {wordnet_dir}")
        kind = rng.choices(kinds, weights)[0]
        prompt = _fill(rng.choice(TEMPLATES[kind]), rng, pools)
        if prompt in seen or banned.hit(prompt):
            continue
        seen.add(prompt)
        out.append(prompt)
    return out
