"""A built-in synthetic corpus with real structure (no downloads).

Design notes: `docs/data.md`, under this file's name.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

# Bump when the grammar changes, so cached corpora are regenerated.
GENERATOR_VERSION = 1

# --------------------------------------------------------------------------- #
# Lexicon
# --------------------------------------------------------------------------- #

NAMES: tuple[tuple[str, str], ...] = (
    ("Mara", "f"), ("Tom", "m"), ("Lena", "f"), ("Omar", "m"), ("Ines", "f"),
    ("Hugo", "m"), ("Nora", "f"), ("Ivan", "m"), ("Sofia", "f"), ("Ravi", "m"),
    ("Yuki", "f"), ("Pablo", "m"), ("Alma", "f"), ("Felix", "m"), ("Zara", "f"),
    ("Bruno", "m"), ("Elsa", "f"), ("Karl", "m"), ("Maya", "f"), ("Leo", "m"),
    ("Anna", "f"), ("Sam", "m"), ("Rosa", "f"), ("Ben", "m"), ("Ida", "f"),
    ("Marco", "m"), ("Tara", "f"), ("Jonas", "m"), ("Vera", "f"), ("Otto", "m"),
)
CITIES = (
    "Oslo", "Lima", "Cairo", "Rome", "Paris", "Tokyo", "Delhi", "Quito", "Dublin",
    "Madrid", "Vienna", "Prague", "Nairobi", "Sydney", "Boston", "Denver", "Lagos",
    "Seoul", "Hanoi", "Athens", "Berlin", "Lisbon", "Warsaw", "Havana",
)
JOBS = (
    "baker", "teacher", "doctor", "farmer", "pilot", "painter", "nurse", "singer",
    "driver", "writer", "tailor", "chef", "artist", "engineer", "editor", "actor",
    "architect", "officer",
)
# (singular, plural)
PETS = (
    ("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("horse", "horses"),
    ("rabbit", "rabbits"), ("goat", "goats"), ("fish", "fish"), ("mouse", "mice"),
    ("parrot", "parrots"), ("turtle", "turtles"),
)
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black", "pink", "brown")
FOODS = ("soup", "rice", "bread", "cheese", "pasta", "curry", "salad", "noodles", "pie", "fish")
ITEMS = (
    ("apple", "apples"), ("book", "books"), ("egg", "eggs"), ("coin", "coins"),
    ("pencil", "pencils"), ("orange", "oranges"), ("letter", "letters"), ("cup", "cups"),
)
NUMBER_WORDS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
    "seventeen", "eighteen", "nineteen", "twenty",
)
# Filler nouns: (singular, plural)
NOUNS = (
    ("dog", "dogs"), ("child", "children"), ("bird", "birds"), ("teacher", "teachers"),
    ("man", "men"), ("woman", "women"), ("student", "students"), ("farmer", "farmers"),
    ("horse", "horses"), ("girl", "girls"), ("boy", "boys"), ("neighbor", "neighbors"),
    ("owl", "owls"), ("old man", "old men"), ("tourist", "tourists"), ("cook", "cooks"),
)
ADJECTIVES = ("small", "old", "young", "quiet", "happy", "tired", "little", "busy", "kind", "loud")
# Intransitive verbs: (3rd person singular, plural / base)
VERBS = (
    ("runs", "run"), ("sleeps", "sleep"), ("sings", "sing"), ("waits", "wait"),
    ("walks", "walk"), ("plays", "play"), ("works", "work"), ("eats", "eat"),
    ("reads", "read"), ("laughs", "laugh"), ("rests", "rest"), ("talks", "talk"),
)
PLACES = (
    "in the park", "near the river", "at the market", "in the garden", "by the lake",
    "at the station", "in the kitchen", "on the hill", "at school", "near the old bridge",
    "in the forest", "at home",
)
TIMES = (
    "Every morning,", "In the evening,", "On Sundays,", "After lunch,", "Most days,",
    "At night,", "In the summer,", "Today,",
)
ADVERBS = ("slowly", "happily", "quietly", "all day", "for a while", "again", "together")
ATTRACTORS = (
    "near the old bridge", "with the red hats", "from the village", "behind the houses",
    "next to the trees", "in the big coats",
)
WEATHER = (
    "The sky is grey.", "The sun is warm.", "It is raining.", "The wind is cold.",
    "The streets are quiet.", "The days are long.", "The nights are cold.",
)

ATTRIBUTES = ("city", "job", "pets", "color", "food")
# Attributes with a single-word answer (used by the cloze task).
CLOZE_ATTRIBUTES = ("city", "color", "food", "name")


def article(word: str) -> str:
    """'a' or 'an' agreeing with the next word."""
    return "an" if word[0].lower() in "aeiou" else "a"


def count_phrase(n: int, sing: str, plur: str) -> str:
    return f"{NUMBER_WORDS[n]} {sing if n == 1 else plur}"


# --------------------------------------------------------------------------- #
# Entities and documents
# --------------------------------------------------------------------------- #


@dataclass
class Entity:
    name: str
    gender: str  # "m" | "f"
    city: str
    job: str
    pet: tuple[str, str]
    pet_count: int
    color: str
    food: str
    introduced: list[str] = field(default_factory=list)  # attributes stated so far

    @property
    def subj(self) -> str:
        return "he" if self.gender == "m" else "she"

    @property
    def poss(self) -> str:
        return "his" if self.gender == "m" else "her"

    def value(self, attr: str) -> str:
        """The canonical answer phrase of an attribute (what an ending must say)."""
        if attr == "city":
            return self.city
        if attr == "job":
            return f"{article(self.job)} {self.job}"
        if attr == "pets":
            return count_phrase(self.pet_count, *self.pet)
        if attr == "color":
            return self.color
        if attr == "food":
            return self.food
        if attr == "name":
            return self.name
        raise KeyError(attr)


@dataclass
class Document:
    sentences: list[str]
    entities: list[Entity]

    @property
    def text(self) -> str:
        return " ".join(self.sentences)


def stream_rng(seed: int, stream: str) -> random.Random:
    """A `random.Random` for (seed, stream); different streams never share a sequence."""
    digest = hashlib.sha256(f"hldstudy.synthetic/{int(seed)}/{stream}".encode()).digest()
    return random.Random(int.from_bytes(digest[:16], "little"))


def sample_entities(rng: random.Random, k: int) -> list[Entity]:
    people = rng.sample(NAMES, k)
    cities = rng.sample(CITIES, k)
    jobs = rng.sample(JOBS, k)
    colors = rng.sample(COLORS, k)
    foods = rng.sample(FOODS, k)
    out = []
    for i, (name, g) in enumerate(people):
        out.append(Entity(name=name, gender=g, city=cities[i], job=jobs[i],
                          pet=rng.choice(PETS), pet_count=rng.randint(1, 6),
                          color=colors[i], food=foods[i]))
    return out


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def fact_sentence(e: Entity, attr: str, rng: random.Random, use_pronoun: bool = False) -> str:
    """States one fact about `e` with a randomly chosen template."""
    who = e.subj if use_pronoun else e.name
    if attr == "city":
        t = rng.choice((
            "{w} lives in {c}.", "{w} lives in {c} now.", "{w} has a small house in {c}.",
            "{w} moved to {c} a few years ago and still lives there.",
        ))
        return _cap(t.format(w=who, c=e.city))
    if attr == "job":
        t = rng.choice(("{w} is {a} {j}.", "{w} works as {a} {j}.",
                        "By day, {w} works as {a} {j}."))
        return _cap(t.format(w=who, a=article(e.job), j=e.job))
    if attr == "pets":
        p = count_phrase(e.pet_count, *e.pet)
        t = rng.choice(("{w} has {p}.", "{w} owns {p}.", "{w} takes care of {p}."))
        return _cap(t.format(w=who, p=p))
    whose = e.poss if use_pronoun else f"{e.name}'s"
    if attr == "color":
        t = rng.choice(("{p} favorite color is {c}.", "{w} likes the color {c}.",
                        "{w} loves everything that is {c}."))
        return _cap(t.format(w=who, p=whose, c=e.color))
    if attr == "food":
        t = rng.choice(("{w} likes to eat {f}.", "{p} favorite food is {f}.",
                        "{w} eats {f} almost every day."))
        return _cap(t.format(w=who, p=whose, f=e.food))
    raise KeyError(attr)


def question_answer(e: Entity, attr: str, rng: random.Random,
                    pronoun_answer: bool | None = None) -> tuple[str, str, str]:
    """(question, answer prefix, answer value + '.'): e.g.
    ("Where does Mara live?", "Mara lives in", "Oslo.").
    The prefix starts with the name or (pronoun_answer) a lower-case pronoun."""
    if pronoun_answer is None:
        pronoun_answer = rng.random() < 0.3
    who = e.subj if pronoun_answer else e.name
    whose = e.poss if pronoun_answer else f"{e.name}'s"
    if attr == "city":
        return f"Where does {e.name} live?", f"{who} lives in", f"{e.city}."
    if attr == "job":
        return (f"What does {e.name} do for work?", f"{who} works as",
                f"{article(e.job)} {e.job}.")
    if attr == "pets":
        sing, plur = e.pet
        return (f"How many {plur} does {e.name} have?", f"{who} has",
                f"{count_phrase(e.pet_count, sing, plur)}.")
    if attr == "color":
        return (f"What is {e.name}'s favorite color?", f"{whose} favorite color is",
                f"{e.color}.")
    if attr == "food":
        return (f"What does {e.name} like to eat?", f"{who} likes to eat", f"{e.food}.")
    raise KeyError(attr)


def distractor_values(e: Entity, attr: str, others: list[Entity], rng: random.Random,
                      k: int = 3) -> list[str]:
    """k wrong answer values for `attr`, other entities' values first."""
    truth = e.value(attr)
    cands: list[str] = []
    for o in others:
        v = o.value(attr)
        if v != truth and v not in cands:
            cands.append(v)
    rng.shuffle(cands)
    pool: list[str]
    if attr == "city":
        pool = list(CITIES)
    elif attr == "job":
        pool = [f"{article(j)} {j}" for j in JOBS]
    elif attr == "pets":
        pool = [count_phrase(n, *e.pet) for n in range(1, 10)]
        pool += [count_phrase(e.pet_count, *p) for p in PETS]
    elif attr == "color":
        pool = list(COLORS)
    elif attr == "food":
        pool = list(FOODS)
    elif attr == "name":
        pool = [n for n, _ in NAMES]
    else:
        raise KeyError(attr)
    rng.shuffle(pool)
    for v in pool:
        if len(cands) >= k:
            break
        if v != truth and v not in cands:
            cands.append(v)
    return cands[:k]


def filler_sentence(rng: random.Random) -> str:
    """A sentence whose verb agrees with a singular or plural subject."""
    r = rng.random()
    sing, plur = rng.choice(NOUNS)
    vs, vp = rng.choice(VERBS)
    plural = rng.random() < 0.5
    if r < 0.35:
        adj = rng.choice(ADJECTIVES) + " " if rng.random() < 0.5 else ""
        if plural:
            det = rng.choice(("The", "The", "Some", "Many", NUMBER_WORDS[rng.randint(2, 5)].capitalize()))
            return f"{det} {adj}{plur} {vp} {rng.choice(PLACES)}."
        det = rng.choice(("The", "The", "One", "A"))
        if det == "A":
            det = article(adj or sing).capitalize()
        return f"{det} {adj}{sing} {vs} {rng.choice(PLACES)}."
    if r < 0.55:
        # Agreement across an attractor phrase.
        att = rng.choice(ATTRACTORS)
        be = "are" if plural else "is"
        return f"The {plur if plural else sing} {att} {be} {rng.choice(ADJECTIVES)}."
    if r < 0.75:
        t = rng.choice(TIMES)
        if plural:
            return f"{t} the {plur} {vp} {rng.choice(ADVERBS)}."
        return f"{t} the {sing} {vs} {rng.choice(ADVERBS)}."
    if r < 0.85:
        has = "have" if plural else "has"
        noun = plur if plural else sing
        return f"The {noun} {has} {rng.choice(('a', 'no', 'one'))} {rng.choice(('garden', 'car', 'boat', 'plan', 'map'))}."
    return rng.choice(WEATHER)


def entity_filler(e: Entity, others: list[Entity], rng: random.Random) -> str:
    """Sentences about an entity (subject agreement with compound subjects)."""
    r = rng.random()
    vs, vp = rng.choice(VERBS)
    if r < 0.4 and others:
        o = rng.choice(others)
        return f"{e.name} and {o.name} {vp} {rng.choice(PLACES)}."
    if r < 0.7:
        return f"{rng.choice(TIMES)} {e.name} {vs} {rng.choice(PLACES)}."
    return f"{e.name} {vs} {rng.choice(ADVERBS)}."


def counting_sentences(e: Entity, rng: random.Random) -> list[str]:
    sing, plur = rng.choice(ITEMS)
    a = rng.randint(1, 9)
    b = rng.randint(1, 9)
    if rng.random() < 0.6:
        return [f"{e.name} had {count_phrase(a, sing, plur)}.",
                f"{_cap(e.subj)} bought {NUMBER_WORDS[b]} more.",
                f"Now {e.subj} has {count_phrase(a + b, sing, plur)}."]
    a, b = max(a, b), min(a, b)
    return [f"{e.name} had {count_phrase(a, sing, plur)}.",
            f"{_cap(e.subj)} gave {NUMBER_WORDS[b]} to a friend.",
            f"Now {e.subj} has {count_phrase(a - b, sing, plur)}."]


def reverse_lookup(e: Entity, rng: random.Random) -> tuple[str, str] | None:
    """(prefix, name) such as ('The baker from Oslo is called', 'Mara'), built only
    from facts already introduced for `e`; None if there are not enough of them."""
    opts = []
    if "city" in e.introduced and "job" in e.introduced:
        opts += [f"The {e.job} from {e.city} is called", f"The {e.job} who lives in {e.city} is"]
    if "color" in e.introduced:
        opts.append(f"The person who loves {e.color} is")
    if not opts:
        return None
    return rng.choice(opts), e.name


def sample_document(rng: random.Random, *, recall: bool = True) -> Document:
    """One document: introductions, filler/counting, then recall of earlier facts."""
    k = rng.choice((1, 2, 2, 2, 3))
    ents = sample_entities(rng, k)
    sents: list[str] = []
    if rng.random() < 0.2:
        sents.append(filler_sentence(rng))
    # Introductions: each entity gets 1-3 facts; a pronoun may refer back.
    for e in ents:
        attrs = rng.sample(ATTRIBUTES, rng.choice((1, 2, 2, 3) if k < 3 else (1, 1, 2)))
        for j, a in enumerate(attrs):
            sents.append(fact_sentence(e, a, rng, use_pronoun=j > 0 and rng.random() < 0.5))
            e.introduced.append(a)
    # Middle: filler, entity activity and counting, in random order.
    middle: list[list[str]] = []
    for _ in range(rng.randint(0, 2)):
        middle.append([filler_sentence(rng)])
    if rng.random() < 0.5:
        e = rng.choice(ents)
        middle.append([entity_filler(e, [o for o in ents if o is not e], rng)])
    if rng.random() < 0.25:
        middle.append(counting_sentences(rng.choice(ents), rng))
    rng.shuffle(middle)
    for m in middle:
        sents.extend(m)
    if recall:
        # Recall: questions and answers about introduced facts.
        n_q = rng.choice((1, 1, 2, 2, 3))
        for _ in range(n_q):
            e = rng.choice(ents)
            a = rng.choice(e.introduced)
            if rng.random() < 0.15:
                rl = reverse_lookup(e, rng)
                if rl is not None:
                    sents.append(f"{rl[0]} {rl[1]}.")
                    continue
            if rng.random() < 0.3:  # restated (by name) without the question
                _, pre, ans = question_answer(e, a, rng, pronoun_answer=False)
                sents.append(f"{_cap(pre)} {ans}")
            else:
                q, pre, ans = question_answer(e, a, rng)
                sents.append(f"{q} {_cap(pre)} {ans}")
    return Document(sents, ents)


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #


def generate_documents(n_docs: int, seed: int, *, split: str = "train") -> list[str]:
    """`n_docs` synthetic documents, deterministic in (seed, split) and prefix-stable."""
    if n_docs < 0:
        raise ValueError(f"n_docs must be >= 0, got {n_docs}")
    rng = stream_rng(seed, split)
    return [sample_document(rng).text for _ in range(n_docs)]


def make_multiple_choice(n: int, seed: int) -> list[dict]:
    """HellaSwag-style items: document + question, 4 endings, one consistent with the facts."""
    rng = stream_rng(seed, "eval/multiple_choice")
    out = []
    for i in range(n):
        doc = sample_document(rng, recall=False)
        e = rng.choice(doc.entities)
        attr = rng.choice(e.introduced)
        q, pre, ans = question_answer(e, attr, rng, pronoun_answer=True)
        others = [o for o in doc.entities if o is not e]
        wrong = distractor_values(e, attr, others, rng, k=3)
        endings = [ans] + [w + "." for w in wrong]
        order = list(range(4))
        rng.shuffle(order)
        endings = [endings[j] for j in order]
        label = order.index(0)
        ctx_a = f"{doc.text} {q}"
        ctx_b = pre  # starts lower-case ("she lives in", "his favorite color is")
        out.append({
            "ind": i,
            "ctx_a": ctx_a,
            "ctx_b": ctx_b,
            "ctx": f"{ctx_a} {_cap(ctx_b)}",
            "activity_label": f"Recall {attr}",
            "endings": endings,
            "label": str(label),
            "source_id": f"synthetic-mc-{seed}-{i}",
            "split": "validation",
            "split_type": "indomain",
        })
    return out


def make_cloze(n: int, seed: int) -> list[dict]:
    """LAMBADA-style items: the final word (no punctuation) is recoverable from context."""
    rng = stream_rng(seed, "eval/cloze")
    out = []
    while len(out) < n:
        doc = sample_document(rng, recall=False)
        e = rng.choice(doc.entities)
        choices = [a for a in ("city", "color", "food") if a in e.introduced]
        rl = reverse_lookup(e, rng)
        if rl is not None:
            choices.append("name")
        if not choices:
            continue
        attr = rng.choice(choices)
        if attr == "name":
            prefix, word = rl
            text = f"{doc.text} {prefix} {word}"
        else:
            q, pre, ans = question_answer(e, attr, rng)
            word = ans.rstrip(".")
            text = f"{doc.text} {q} {_cap(pre)} {word}"
        out.append({"text": text})
    return out


def cloze_target(item: dict) -> tuple[str, str]:
    """(context, target) split as lm-eval's lambada does: the last space-separated word."""
    ctx, word = item["text"].rsplit(" ", 1)
    return ctx, " " + word


def save_eval_tasks(directory, n_multiple_choice: int = 1000, n_cloze: int = 1000,
                    seed: int = 0) -> dict[str, str]:
    """Writes `synthetic_hellaswag.jsonl` and `synthetic_lambada.jsonl` (one item per
    line, HF hellaswag / lambada schemas) into `directory`; returns {task: path}."""
    import json
    from pathlib import Path

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, items in (("synthetic_hellaswag", make_multiple_choice(n_multiple_choice, seed)),
                        ("synthetic_lambada", make_cloze(n_cloze, seed))):
        path = d / f"{name}.jsonl"
        path.write_text("".join(json.dumps(it) + "\n" for it in items))
        out[name] = str(path)
    return out
