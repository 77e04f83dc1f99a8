"""A fictional encyclopedia for multi-hop search: questions that no pretrained model can answer without
searching.

``generate_world(seed)`` invents a small world (``shared_world(seed)``: built once per process):
countries, cities, organisations (publishing houses, film studios, record labels, institutes), people
and works (novels, films, albums), every name made of invented syllables, linked by ten relations
(``RELATIONS``: a work's creator, publisher and release year; a person's birthplace, birth year and
employer; an organisation's founder, headquarters and founding year; a city's country). Each entity
has a main passage (titled with its name) that states its facts, each fact in one of several
paraphrases ("X was born in Y in 1893." / "Born in Y in 1893, X became ..."). Distractors come in two
kinds: namesakes (people share given and family names, so a search for "Velmora Quist" also finds
"Aldren Quist" and "Velmora Tarnby"), and passages that mention an entity without stating the asked
fact ("X (legacy)", "W (reception)": other cities, people and years beside the entity's name).

Questions (``make_dataset``) follow HotpotQA (Yang et al. 2018, arXiv 1809.09600) and MuSiQue (Trivedi
et al. 2022, arXiv 2108.00573):

- ``bridge`` (2 hops): "In which city was the author of the novel W born?"
- ``comparison`` (2 hops): "Who was born first, A or B?", "Which was founded earlier, O1 or O2?",
  "Which came out first, the novel W1 or the film W2?"; the answer is one of the two (so, as in
  HotpotQA, a coin flip gets half of them right without searching);
- ``3-hop`` and ``4-hop`` compositions of relations (MuSiQue-style): "In which country is the birthplace
  of the founder of the label that released the album W?"

A row holds the HotpotQA fields multihop_qa reads (``id``, ``prompt``, ``question``, ``answer``,
``type``, ``supporting_titles``) plus ``kind``, ``hops``, ``answer_type``, ``supporting_ids``,
``entities`` (the ids of every entity the question involves) and ``steps`` (one per search a
competent agent makes: subject, relation, query, supporting passage id, the value found).

Splits: the world is two disjoint sub-worlds, ``train`` and ``test``, each with its own countries,
cities, organisations, people and works, and its own pool of invented name syllable-words; a question
only involves entities of its split. So no held-out question names, or is answered by, an entity of a
train question, and a closed-book answer can only be a guess: the answers are invented names that
appear nowhere but in this corpus, or years. The search corpus holds both sub-worlds.

The env is multihop_qa's (``ToolEnv`` with the ``search`` tool, ``SYSTEM_PROMPT``, ``<answer>``,
HotpotQA exact match or F1), over BM25 on the world's corpus by default.

The demonstrator (``demonstrate``) searches one hop at a time with the query a competent agent would
write (the subject's name and a keyword of the relation) and answers the last value. With probability
``error_rate`` it is wrong in one of the ways a search agent is: it answers an intermediate hop's value
too early; it takes a value of the right type from a distractor passage the last search returned (a
namesake's birth year, the city a prize was founded in); or, on a comparison, it names the other
candidate. Every such answer is wrong by construction, so the
demonstrations' exact-match rate is ``1 - error_rate`` up to sampling noise.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from agent_r1.tasks import TaskSpec
from agent_r1.tasks.multihop_qa import SYSTEM_PROMPT, check_reward, search_task
from agent_r1.tools.search import BM25Retriever, Passage

__all__ = [
    "KINDS",
    "RELATIONS",
    "Entity",
    "World",
    "WorldSize",
    "answer_text",
    "build_task",
    "demonstrate",
    "generate_world",
    "make_dataset",
    "search_call",
    "search_query",
    "shared_world",
    "write_corpus",
]

SPLITS = ("train", "test")
# relation -> (subject type, object type); "year" objects are years, the others entity ids.
RELATIONS: dict[str, tuple[str, str]] = {
    "creator": ("work", "person"),
    "publisher": ("work", "organisation"),
    "release_year": ("work", "year"),
    "birthplace": ("person", "city"),
    "birth_year": ("person", "year"),
    "employer": ("person", "organisation"),
    "founder": ("organisation", "person"),
    "headquarters": ("organisation", "city"),
    "founding_year": ("organisation", "year"),
    "country": ("city", "country"),
}
# question kind -> (HotpotQA-style type, hops)
KINDS: dict[str, tuple[str, int]] = {
    "bridge": ("bridge", 2),
    "comparison": ("comparison", 2),
    "3-hop": ("compose", 3),
    "4-hop": ("compose", 4),
}
DEFAULT_MIX: dict[str, float] = {"bridge": 0.3, "comparison": 0.2, "3-hop": 0.3, "4-hop": 0.2}
_YEAR_RE = re.compile(r"\b(?:18|19|20)\d\d\b")


@dataclass(frozen=True)
class WorldSize:
    """Entities of EACH split (the world holds two sub-worlds of this size)."""

    countries: int = 12
    cities: int = 48
    organisations: int = 64  # a quarter each: publishing houses, film studios, record labels, institutes
    people: int = 240
    works: int = 180  # a third each: novels, films, albums

    def __post_init__(self) -> None:
        for name, least in (
            ("countries", 2),
            ("cities", 4),
            ("organisations", 8),
            ("people", 16),
            ("works", 6),
        ):
            if getattr(self, name) < least:
                raise ValueError(f"WorldSize.{name} must be >= {least}, got {getattr(self, name)}")
        if self.cities < self.countries:
            raise ValueError("WorldSize.cities must be >= countries (every country has a city)")
        if self.people < self.organisations + 2:
            raise ValueError(
                "WorldSize.people must exceed organisations (each organisation has its own founder)"
            )


@dataclass(frozen=True, eq=False)
class Entity:
    id: str  # "test-person-17"; also the id of its main passage
    type: str  # person | city | country | organisation | work
    name: str
    split: str
    facts: Mapping[str, str]  # relation -> object entity id, or a year as digits
    # work: novel | film | album; organisation: press | studio | label | institute; person: occupation
    subtype: str = ""


@dataclass(frozen=True, eq=False)
class World:
    """Entities by id and the passages of the corpus (main passages first, then distractors)."""

    seed: int
    size: WorldSize
    entities: Mapping[str, Entity]
    passages: tuple[Passage, ...]

    @cached_property
    def retriever(self) -> BM25Retriever:
        """BM25 over the whole corpus (both splits), built on first use."""
        return BM25Retriever(self.passages)

    def value(self, entity: Entity, relation: str) -> str:
        """What a reader finds for ``relation`` of ``entity``: a name, or a year."""
        raw = entity.facts[relation]
        return raw if RELATIONS[relation][1] == "year" else self.entities[raw].name

    @cached_property
    def names(self) -> dict[str, list[str]]:
        """Entity names by type, both splits."""
        names: dict[str, list[str]] = {}
        for entity in self.entities.values():
            names.setdefault(entity.type, []).append(entity.name)
        return names

    def of_type(self, split: str, entity_type: str) -> list[Entity]:
        return [e for e in self.entities.values() if e.split == split and e.type == entity_type]


# ------------------------------------------------------------------------------------------- names

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "pr", "qu", "r",
           "s", "sh", "st", "t", "th", "tr", "v", "z")  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ei", "ia")
_CODAS = ("", "", "", "", "", "n", "r", "l", "s", "m", "nd", "rn", "x")
_COUNTRY_ENDINGS = ("ia", "ora", "and", "eth", "avia", "istan", "esh")
_CITY_ENDINGS = ("", "", "", "", "burg", "mouth", "holm", "ford", "port")
_ORG_SUFFIXES = {
    "press": ("Press", "Books", "Publishing"),
    "studio": ("Pictures", "Studios", "Films"),
    "label": ("Records", "Recordings", "Music"),
    "institute": ("Institute", "Society", "Foundation"),
}
_ORG_NOUNS = {
    "press": "publishing house",
    "studio": "film studio",
    "label": "record label",
    "institute": "institute",
}
_WORK_SECTOR = {"novel": "press", "film": "studio", "album": "label"}
_TITLE_NOUNS = ("Lantern", "River", "Garden", "Winter", "Harbour", "Mirror", "Orchard", "Tower",
                "Silence", "Voyage", "Ember", "Meadow", "Crown", "Tide", "Compass", "Ashes", "Bell",
                "Thread")  # fmt: skip
_OCCUPATIONS = ("painter", "engineer", "novelist", "composer", "physician", "architect", "botanist",
                "photographer", "mathematician", "diplomat", "sculptor", "historian")  # fmt: skip
_REGIONS = ("north", "south", "east", "west")


class _Words:
    """Invented capitalised words, never repeated in one world."""

    def __init__(self, rng: random.Random, used: set[str]) -> None:
        self.rng, self.used = rng, used

    def new(self, syllables: tuple[int, int] = (2, 2), ending: Sequence[str] = ("",)) -> str:
        while True:
            parts = [
                self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                for _ in range(self.rng.randint(*syllables))
            ]
            word = ("".join(parts) + self.rng.choice(ending)).capitalize()
            if 5 <= len(word) <= 12 and word.lower() not in self.used:
                self.used.add(word.lower())
                return word


# ------------------------------------------------------------------------------------------- world


def shared_world(seed: int = 0, size: WorldSize | None = None) -> World:
    """``generate_world(seed, size)``, built once per process and shared (with its BM25 index) by the
    datasets, tools and demonstrators of every task built on it."""
    return _shared_world(seed, size or WorldSize())


@functools.lru_cache(maxsize=4)
def _shared_world(seed: int, size: WorldSize) -> World:
    return generate_world(seed, size)


def generate_world(seed: int = 0, size: WorldSize | None = None) -> World:
    """The world of ``seed`` (deterministic): two disjoint sub-worlds of ``size`` (default
    ``WorldSize()``) each."""
    size = size or WorldSize()
    rng = random.Random(f"multihop_world-{seed}")
    used: set[str] = set()
    entities: dict[str, Entity] = {}
    mains: list[Passage] = []
    distractors: list[Passage] = []
    for split in SPLITS:
        sub = _sub_world(split, rng, _Words(rng, used), size)
        entities.update((e.id, e) for e in sub)
    world = World(seed, size, entities, ())
    for entity in entities.values():
        mains.append(Passage(entity.id, _main_text(world, entity, rng), entity.name))
        if entity.type != "country" and rng.random() < 0.6:
            distractors.append(_distractor(world, entity, rng))
    return World(seed, size, entities, (*mains, *distractors))


def _sub_world(split: str, rng: random.Random, words: _Words, size: WorldSize) -> list[Entity]:
    def ident(entity_type: str, i: int) -> str:
        return f"{split}-{entity_type}-{i}"

    countries = [Entity(ident("country", i), "country", words.new((2, 2), _COUNTRY_ENDINGS), split, {})
                 for i in range(size.countries)]  # fmt: skip
    # every country has a city; the others are spread at random
    city_countries = [c.id for c in countries] + [
        rng.choice(countries).id for _ in range(size.cities - size.countries)
    ]
    cities = [
        Entity(ident("city", i), "city", words.new((2, 2), _CITY_ENDINGS), split, {"country": country})
        for i, country in enumerate(city_countries)
    ]
    sectors = list(itertools.islice(itertools.cycle(_ORG_SUFFIXES), size.organisations))
    org_names = [f"{words.new()} {rng.choice(_ORG_SUFFIXES[s])}" for s in sectors]
    # Namesakes by construction: fewer given and family names than people.
    given = [words.new((2, 2)) for _ in range(max(4, size.people * 3 // 5))]
    family = [words.new() for _ in range(max(4, size.people // 2))]
    names: set[str] = set()
    people: list[dict[str, Any]] = []
    while len(people) < size.people:
        name = f"{rng.choice(given)} {rng.choice(family)}"
        if name in names:
            continue
        names.add(name)
        people.append(
            {
                "name": name,
                "birth_year": rng.randint(1820, 1960),
                "birthplace": rng.choice(cities).id,
                "employer": rng.randrange(size.organisations),
                "occupation": rng.choice(_OCCUPATIONS),
            }
        )
    founders = rng.sample(range(size.people), size.organisations)
    organisations = []
    for i, (sector, name, founder) in enumerate(zip(sectors, org_names, founders, strict=True)):
        if people[founder]["employer"] == i:  # nobody works for the organisation they founded: no loops
            people[founder]["employer"] = (i + 1) % size.organisations
        facts = {
            "founder": ident("person", founder),
            "founding_year": str(people[founder]["birth_year"] + rng.randint(25, 55)),
            "headquarters": rng.choice(cities).id,
        }
        organisations.append(Entity(ident("organisation", i), "organisation", name, split, facts, sector))
    persons = [
        Entity(
            ident("person", i),
            "person",
            p["name"],
            split,
            {
                "birth_year": str(p["birth_year"]),
                "birthplace": p["birthplace"],
                "employer": ident("organisation", p["employer"]),
            },
            p["occupation"],
        )
        for i, p in enumerate(people)
    ]
    works = []
    for i, kind in enumerate(itertools.islice(itertools.cycle(_WORK_SECTOR), size.works)):
        creator = rng.randrange(size.people)
        publisher = rng.choice([o for o in organisations if o.subtype == _WORK_SECTOR[kind]])
        word, noun = words.new(), rng.choice(_TITLE_NOUNS)
        title = rng.choice((f"The {noun} of {word}", f"{word} {noun}", f"The {word} {noun}"))
        facts = {
            "creator": ident("person", creator),
            "publisher": publisher.id,
            "release_year": str(people[creator]["birth_year"] + rng.randint(22, 60)),
        }
        works.append(Entity(ident("work", i), "work", title, split, facts, kind))
    return [*countries, *cities, *organisations, *persons, *works]


def _surname(person: Entity) -> str:
    return person.name.split()[-1]


def _main_text(world: World, e: Entity, rng: random.Random) -> str:
    """The entity's facts, each in one of several paraphrases."""
    v = functools.partial(world.value, e)
    pick = rng.choice
    if e.type == "person":
        name, year, city, org, job = e.name, v("birth_year"), v("birthplace"), v("employer"), e.subtype
        return " ".join((
            pick((f"{name} was a {job}, born in {city} in {year}.",
                  f"Born in {city} in {year}, {name} became a {job}.",
                  f"{name} (born {year} in {city}) was a {job}.")),
            pick((f"{_surname(e)} worked for {org} for most of a long career.",
                  f"For many years {name} was employed by {org}.",
                  f"{_surname(e)} spent {rng.randint(5, 30)} years working at {org}.")),
        ))  # fmt: skip
    if e.type == "city":
        city, country = e.name, v("country")
        return " ".join((
            pick((f"{city} is a city in {country}.",
                  f"{city} lies in the {pick(_REGIONS)} of {country}.",
                  f"The city of {city} is part of {country}.")),
            f"It had about {rng.randint(2, 900) * 1000} inhabitants in {rng.randint(1900, 2000)}.",
        ))  # fmt: skip
    if e.type == "country":
        cities = sorted(c.name for c in world.of_type(e.split, "city") if c.facts["country"] == e.id)
        listed = cities[0] if len(cities) == 1 else f"{', '.join(cities[:-1])} and {cities[-1]}"
        return f"{e.name} is a country. Its cities include {listed}."
    if e.type == "organisation":
        org, year, founder, city = e.name, v("founding_year"), v("founder"), v("headquarters")
        noun = _ORG_NOUNS[e.subtype]
        return " ".join((
            f"{org} is a {noun}.",
            pick((f"It was founded in {year} by {founder}.",
                  f"{founder} founded {org} in {year}.",
                  f"Established in {year}, {org} was the creation of {founder}.")),
            pick((f"Its headquarters are in {city}.",
                  f"{org} is headquartered in {city}.",
                  f"The {noun} is based in {city}.")),
        ))  # fmt: skip
    title, year, creator, org = e.name, v("release_year"), v("creator"), v("publisher")
    templates = {
        "novel": (f"{title} is a novel by {creator}, published by {org} in {year}.",
                  f"{creator} wrote {title}, a novel that {org} published in {year}.",
                  f"Published in {year} by {org}, the novel {title} was written by {creator}."),
        "film": (f"{title} is a film from {year}, directed by {creator} and produced by {org}.",
                 f"{creator} directed the film {title}, which {org} produced in {year}.",
                 f"Produced by {org} and released in {year}, {title} is a film by the director {creator}."),
        "album": (f"{title} is an album recorded by {creator}, released on the {org} label in {year}.",
                  f"{creator} recorded {title}, an album that {org} released in {year}.",
                  f"Released by {org} in {year}, the album {title} is the work of {creator}."),
    }  # fmt: skip
    return pick(templates[e.subtype])


def _distractor(world: World, e: Entity, rng: random.Random) -> Passage:
    """A passage that names ``e`` beside other entities of its split, without stating its facts."""

    def other(entity_type: str, *not_ids: str) -> str:
        return rng.choice([x for x in world.of_type(e.split, entity_type) if x.id not in not_ids]).name

    year = rng.randint(1900, 2010)
    if e.type == "person":
        aspect = "legacy"
        city, org = other("city", e.facts["birthplace"]), other("organisation", e.facts["employer"])
        text = (f"In {year}, a prize named after {e.name} was founded in {city}. "
                f"Letters by {_surname(e)} are kept by {org}.")  # fmt: skip
    elif e.type == "work":
        aspect = "reception"
        work, person = other("work", e.id), other("person", e.facts["creator"])
        text = f"Critics compared {e.name} with {work}, by {person}. A new edition appeared in {year}."
    elif e.type == "organisation":
        aspect = "history"
        text = (f"In {year}, {e.name} opened an office in {other('city', e.facts['headquarters'])}. "
                f"{other('person', e.facts['founder'])} led it for a decade.")  # fmt: skip
    else:
        aspect = "history"
        text = (f"{e.name} was granted a charter in {year}. It is twinned with "
                f"{other('city', e.id)} in {other('country', e.facts['country'])}.")  # fmt: skip
    return Passage(f"{e.id}/{aspect}", text, f"{e.name} ({aspect})")


def write_corpus(world: World, path: str | Path) -> Path:
    """The world's corpus as JSONL passages (``id``, ``title``, ``text``), e.g. for a dense index
    behind a Search-R1 retrieval server (``build_task(retriever_url=...)``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in world.passages:
            f.write(json.dumps({"id": p.id, "title": p.title, "text": p.text}, ensure_ascii=False) + "\n")
    return path


# --------------------------------------------------------------------------------------- questions

# The noun phrase for "relation of X" inside a longer question, by the subject's subtype where it matters.
_PHRASES: dict[str, Any] = {
    "creator": {"novel": "the author of the novel {x}", "film": "the director of the film {x}",
                "album": "the musician who recorded the album {x}"},
    "publisher": {"novel": "the publisher of the novel {x}", "film": "the studio that produced the film {x}",
                  "album": "the label that released the album {x}"},
    "birthplace": "the birthplace of {x}",
    "employer": "the employer of {x}",
    "founder": "the founder of {x}",
    "headquarters": "the city where {x} is headquartered",
}  # fmt: skip
_QUESTIONS = {
    "birthplace": "In which city was {x} born?",
    "birth_year": "In what year was {x} born?",
    "employer": "Which organisation did {x} work for?",
    "founder": "Who founded {x}?",
    "headquarters": "In which city is {x} headquartered?",
    "founding_year": "In what year was {x} founded?",
    "country": "In which country is {x}?",
}
_COMPARISONS = {  # entity type -> (relation, question for the earlier, question for the later)
    "person": ("birth_year", "Who was born first, {a} or {b}?", "Who was born later, {a} or {b}?"),
    "organisation": ("founding_year", "Which was founded earlier, {a} or {b}?",
                     "Which was founded more recently, {a} or {b}?"),
    "work": ("release_year", "Which came out first, the {sa} {a} or the {sb} {b}?",
             "Which came out later, the {sa} {a} or the {sb} {b}?"),
}  # fmt: skip
_QUERY_WORDS = {
    "birthplace": "born",
    "birth_year": "born",
    "employer": "worked",
    "founder": "founded",
    "founding_year": "founded",
    "headquarters": "headquarters",
    "country": "city country",
}


def _chains(hops: int) -> list[tuple[str, ...]]:
    """Every relation path of ``hops`` relations that ends in a question (``_QUESTIONS``)."""
    paths: list[tuple[str, ...]] = [(r,) for r in RELATIONS]
    for _ in range(hops - 1):
        paths = [(*p, r) for p in paths for r in RELATIONS if RELATIONS[r][0] == RELATIONS[p[-1]][1]]
    return [p for p in paths if p[-1] in _QUESTIONS]


CHAINS = {hops: _chains(hops) for hops in (2, 3, 4)}


def search_query(entity: Entity, relation: str) -> str:
    """The query a competent agent writes to find ``relation`` of ``entity``: its name and a keyword."""
    words = entity.subtype if entity.type == "work" else _QUERY_WORDS[relation]
    return f"{entity.name} {words}"


def _step(world: World, entity: Entity, relation: str) -> dict[str, str]:
    return {
        "subject": entity.name,
        "relation": relation,
        "query": search_query(entity, relation),
        "passage": entity.id,
        "value": world.value(entity, relation),
    }


def _compose(world: World, start: Entity, chain: tuple[str, ...]) -> dict[str, Any] | None:
    """A question walking ``chain`` from ``start``; None when the walk revisits an entity."""
    steps, path, phrase, entity = [], [start.id], start.name, start
    for i, relation in enumerate(chain):
        steps.append(_step(world, entity, relation))
        if i < len(chain) - 1:
            template = _PHRASES[relation]
            phrase = (template[entity.subtype] if isinstance(template, dict) else template).format(x=phrase)
            entity = world.entities[entity.facts[relation]]
            if entity.id in path:
                return None
            path.append(entity.id)
    answer_type = RELATIONS[chain[-1]][1]
    if answer_type != "year":
        if entity.facts[chain[-1]] in path:
            return None
        path.append(entity.facts[chain[-1]])
    return {
        "question": _QUESTIONS[chain[-1]].format(x=phrase),
        "answer": steps[-1]["value"],
        "answer_type": answer_type,
        "entities": path,
        "steps": steps,
    }


def _comparison(world: World, split: str, rng: random.Random) -> dict[str, Any] | None:
    entity_type = rng.choice(sorted(_COMPARISONS))
    relation, earlier, later = _COMPARISONS[entity_type]
    a, b = rng.sample(world.of_type(split, entity_type), 2)
    if a.facts[relation] == b.facts[relation]:
        return None
    ask_later = rng.random() < 0.5
    first, second = sorted((a, b), key=lambda e: int(e.facts[relation]))
    answer = second if ask_later else first
    return {
        "question": (later if ask_later else earlier).format(a=a.name, b=b.name, sa=a.subtype, sb=b.subtype),
        "answer": answer.name,
        "answer_type": entity_type,
        "entities": [a.id, b.id],
        "steps": [_step(world, a, relation), _step(world, b, relation)],
        "candidates": [a.name, b.name],
    }


def _question(world: World, split: str, kind: str, rng: random.Random) -> dict[str, Any] | None:
    hotpot_type, hops = KINDS[kind]
    if hotpot_type == "comparison":
        q = _comparison(world, split, rng)
    else:
        chain = rng.choice(CHAINS[hops])
        q = _compose(world, rng.choice(world.of_type(split, RELATIONS[chain[0]][0])), chain)
    if q is None:
        return None
    supporting = list(dict.fromkeys(s["passage"] for s in q["steps"]))
    digest = hashlib.sha256(q["question"].encode()).hexdigest()[:12]
    return {
        "id": f"world{world.seed}-{split}-{digest}",
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q["question"]}],
        "type": hotpot_type,
        "kind": kind,
        "hops": hops,
        "level": "hard" if hops > 2 else "medium",
        "supporting_ids": supporting,
        "supporting_titles": [world.entities[p].name for p in supporting],
        **q,
    }


def make_dataset(
    n: int | None,
    *,
    split: str = "train",
    seed: int = 0,
    world_seed: int = 0,
    size: WorldSize | None = None,
    mix: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """``n`` distinct questions of ``split`` over the world of ``world_seed``, drawn with ``seed``.

    ``mix``: the share of each kind (``KINDS``; default ``DEFAULT_MIX``); a kind left out is not
    asked. The same question has the same id whatever the seed.
    """
    if split not in SPLITS:
        raise ValueError(f"multihop_world make_dataset: split must be 'train' or 'test', got {split!r}")
    if n is None or n < 0:
        raise ValueError(f"multihop_world make_dataset: give a number of questions (generated), got {n!r}")
    mix = dict(DEFAULT_MIX if mix is None else mix)
    unknown = sorted(set(mix) - set(KINDS))
    if unknown or not any(w > 0 for w in mix.values()):
        raise ValueError(f"multihop_world mix {mix}: weights of kinds among {', '.join(KINDS)}, some > 0")
    world = shared_world(world_seed, size)
    rng = random.Random(f"multihop_world-{world_seed}-{split}-{seed}")
    kinds, weights = zip(*mix.items(), strict=True)
    rows: dict[str, dict[str, Any]] = {}
    for _ in range(50 * n + 100):
        if len(rows) == n:
            break
        row = _question(world, split, rng.choices(kinds, weights)[0], rng)
        if row is not None:
            rows.setdefault(row["question"], row)
    if len(rows) < n:
        raise ValueError(
            f"multihop_world: only {len(rows)} distinct {split} questions found of {n}; grow the world"
        )
    return list(rows.values())


# ----------------------------------------------------------------------------------- demonstrator


def search_call(query: str) -> str:
    """A search call in the Hermes / Qwen2.5 format, as the chat template renders one."""
    return f"<tool_call>\n{json.dumps({'name': 'search', 'arguments': {'query': query}})}\n</tool_call>"


def answer_text(answer: str) -> str:
    return f"<answer>{answer}</answer>"


def demonstrate(
    task: Mapping[str, Any], rng: random.Random, *, world: World, error_rate: float = 0.3, top_k: int = 3
) -> list[str]:
    """The assistant responses of one demonstration: a search per step, then the answer.

    With probability ``error_rate`` the answer is wrong (module docstring): a comparison names the
    other candidate; a chain answers an intermediate value too early, or (half the time, when the
    last search returned one) a value of the answer's type from a passage other than the supporting
    one.
    """
    calls = [search_call(step["query"]) for step in task["steps"]]
    if rng.random() >= error_rate:
        return [*calls, answer_text(task["answer"])]
    if task["type"] == "comparison":
        (other,) = [c for c in task["candidates"] if c != task["answer"]]
        return [*calls, answer_text(other)]
    if rng.random() < 0.5 and (wrong := _distractor_value(world, task, top_k)) is not None:
        return [*calls, answer_text(wrong)]
    stop = rng.randrange(1, len(calls))
    return [*calls[:stop], answer_text(task["steps"][stop - 1]["value"])]


def _distractor_value(world: World, task: Mapping[str, Any], top_k: int) -> str | None:
    """A wrong value of the answer's type that a passage the last search returned (not the supporting
    one) states: a namesake's birthplace, the city a prize was founded in, a reissue's year..."""
    last = task["steps"][-1]
    answer_type = RELATIONS[last["relation"]][1]
    for passage in world.retriever.search(last["query"], top_k):
        if passage.id == last["passage"]:
            continue
        if answer_type == "year":
            mentioned = _YEAR_RE.findall(passage.text)
        else:
            names = (n for n in world.names[answer_type] if n in passage.text)
            mentioned = sorted(names, key=passage.text.index)
        wrong = [value for value in mentioned if value != task["answer"]]
        if wrong:
            return wrong[0]
    return None


# ---------------------------------------------------------------------------------------- the task


def build_task(
    *,
    world_seed: int = 0,
    size: Mapping[str, int] | None = None,
    mix: Mapping[str, float] | None = None,
    reward: str = "exact_match",
    top_k: int = 3,
    max_turns: int = 6,
    error_rate: float = 0.3,
    retriever_url: str | None = None,
) -> TaskSpec:
    """The ``multihop_world`` task: the world of ``world_seed`` (``size``: ``WorldSize`` fields per
    split), multihop_qa's search tool and answer rule, ``reward`` ``"exact_match"`` or ``"f1"``.

    The search engine is BM25 over the world's corpus, or a Search-R1 retrieval server at
    ``retriever_url`` that indexes it (``write_corpus``). ``error_rate``: the demonstrator's.
    """
    check_reward("multihop_world", reward)
    if not 0 <= error_rate <= 1:
        raise ValueError(f"multihop_world error_rate must be in [0, 1], got {error_rate}")
    unknown = sorted(set(size or {}) - set(WorldSize.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"multihop_world size: unknown fields {unknown}; known: {list(WorldSize.__dataclass_fields__)}"
        )
    world_size = WorldSize(**dict(size or {}))
    world = shared_world(world_seed, world_size)
    return search_task(
        "multihop_world",
        make_dataset=functools.partial(make_dataset, world_seed=world_seed, size=world_size, mix=mix),
        retriever=lambda: world.retriever,
        retriever_url=retriever_url,
        reward=reward,
        top_k=top_k,
        max_turns=max_turns,
        demonstrate=functools.partial(demonstrate, world=world, error_rate=error_rate, top_k=top_k),
    )
