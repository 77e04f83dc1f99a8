"""Shop: a WebShop-like shopping task (Yao et al. 2022, arXiv 2207.01206), built here procedurally.

WebShop serves 1.18M scraped Amazon products from a Flask site searched by pyserini (Java); neither
runs offline from PyPI alone, so this module generates a catalog of its own with WebShop's text
interface:

- **The catalog** (``catalog()``) is fixed, the same for every seed: 30 products in each of 12
  categories (``jacket``, ``t-shirt``, ``mug``, ``headphones``, ..., ``phone case``). A product has
  an id (``p042``), a title (a made-up brand, one or two of its attributes, its category), three or
  four attributes from its category's vocabulary (``waterproof``, ``stainless steel``; some shared
  between categories), the values it offers in each of its category's option groups (``color``;
  ``size``, ``capacity`` or ``model``) and a price (never a round number: "lower than" is "<=").
- **Pages and actions** are WebShop's text mode: on the search page ``search[query]`` (free text,
  read up to 60 characters); the results page lists the top 5 products by BM25 over their title and
  attributes (ties to the lower id), each as ``click[<id>]`` with its title and price, and
  ``click[back to search]``; an item page shows the title, price and attributes, each option value
  as ``click[<value>]`` (a later click in a group replaces the earlier one), ``click[buy now]``,
  ``click[< prev]`` and ``click[back to search]``. Anything not admissible answers ``Nothing
  happens.`` and costs its step (``info["invalid"]``). Buying ends the episode.
- **Instructions** are in WebShop's wording: ``i need a waterproof, lightweight jacket in blue, size
  m, and price lower than 50.00 dollars``, drawn from one product: one or two of its attributes, a
  value in one or both of its option groups, a limit 10-30 dollars above its price rounded down to
  ten. Any product that satisfies all of it is a right answer.
- **The reward** at buy is WebShop's, simplified: ``r = r_type * (|goal attributes ∩ product
  attributes| + |goal options ∩ chosen options| + 1[price <= limit]) / (|goal attributes| + |goal
  options| + 1)``, matched exactly (WebShop matches attributes and options fuzzily, as text), with
  ``r_type`` 1 for a product of the goal's category and 0.1 otherwise (WebShop grades the product's
  type by text similarity). ``success`` is ``r == 1``; the budget spent without buying gives 0. A
  policy that buys anything gets partial credit, so a group's rewards vary even when success is rare.
- **Splits.** ``train`` and ``test`` are disjoint by a hash of the goal (category, attributes,
  options, limit), as household's seen split; there is no unseen catalog.

Deviations from WebShop, each for the project's 1M-parameter byte-level model (every character a
token, 2,048 positions): **the env chooses the context** (docs/environments.md, "Context policies"):
each turn's prompt is rewritten from the state (the instruction, the page, the last feedback, the
admissible actions), so it stays under ~700 characters whatever the episode's length; the clicks are
numbered and a reply may be the number (``search[...]`` stays free text); there are no description,
features or reviews pages and no ``next >``; the budget is the shortest solution (search, click a
product, one click per goal option, buy: 4-5 actions) plus ``slack`` (2), as household's.

The demonstrator (``demonstrate``) searches ``search[<goal attributes> <category>]``, clicks the
first result that satisfies the goal, selects each goal option and buys, with one *systematic*
habit: with probability ``error_rate`` it forgets the instruction's last option and buys straight
after the others. Every goal names an option, so the habit always costs reward, and never all of it
(``r = (k - 1) / k`` for ``k`` goal terms and the price: 0.67-0.8): a habit made at one state (the
item page, one option short), which a model cloned from it repeats and RL can fix. On 1,000 train
tasks (seed 0): success 0.49 and mean reward 0.87 at the default 0.5; 0.60 and 0.89 at 0.4; 1.00
at 0; 0.00 and 0.73 at 1.

``query="category"`` makes it search the category alone (``search[desk chair]``): the tiny model,
warm-started on the goal's query (800 numbered demonstrations x 3 epochs, seed 0), garbles it
(``search[leather c camontase mug]`` for a desk chair) and scores 1.1 (x100) held out, 1.3 after
GRPO; the category is one of 12 strings to write. Its results then hold a product that satisfies
the goal for 58% of the tasks; otherwise it buys the listed product worth most, with the goal's
options it offers: success 0.58 and mean reward 0.88 at error_rate 0, 0.29 and 0.75 at 0.5.
Warm-started so (seed 0) the tiny model writes the right category mostly, then clicks a product
and buys at once (``3``, the most frequent number): score 19.0. ``options_by_text`` (options
clicked by value, ``click[blue]``, the rest by number) gives 21.0, and GRPO at the paper table's
budget moves that to 25.1 (docs/paper_table.md).
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent_r1.envs.base import AgentEnv
from agent_r1.tasks.listed_actions import check_env_arguments, listed_action, out_of_budget
from agent_r1.types import Action, Observation, StepResult

__all__ = [
    "CATEGORIES",
    "SYSTEM_PROMPT",
    "Goal",
    "Product",
    "Shop",
    "ShopEnv",
    "build_task",
    "catalog",
    "chosen_action",
    "demonstrate",
    "demonstrator_query",
    "make_dataset",
    "make_env",
    "parse_action",
    "purchase_reward",
    "satisfies",
    "search",
]

SYSTEM_PROMPT = "Reply with one action from the list."


@dataclass(frozen=True)
class Category:
    """A category's attribute vocabulary, its option groups (each group's values) and price range."""

    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]]
    price: tuple[int, int]


CATEGORIES = {
    "jacket": Category(
        ("waterproof", "lightweight", "insulated", "hooded", "windproof", "packable", "fleece lined"),
        {"color": ("black", "blue", "red", "green", "grey"), "size": ("s", "m", "l", "xl")},
        (30, 150),
    ),
    "t-shirt": Category(
        ("cotton", "slim fit", "moisture wicking", "quick dry", "v-neck", "organic", "lightweight"),
        {"color": ("white", "black", "navy", "red", "grey"), "size": ("s", "m", "l", "xl")},
        (8, 40),
    ),
    "mug": Category(
        ("ceramic", "stainless steel", "insulated", "dishwasher safe", "microwave safe", "travel", "matte"),
        {"color": ("white", "black", "blue", "green"), "capacity": ("12 oz", "16 oz", "20 oz")},
        (8, 35),
    ),
    "headphones": Category(
        ("wireless", "noise cancelling", "over ear", "foldable", "bluetooth", "lightweight", "waterproof"),
        {"color": ("black", "white", "silver", "blue")},
        (20, 200),
    ),
    "backpack": Category(
        ("waterproof", "lightweight", "anti theft", "laptop sleeve", "usb charging", "padded", "foldable"),
        {"color": ("black", "grey", "navy", "green", "red"), "capacity": ("20l", "30l", "40l")},
        (25, 120),
    ),
    "sneakers": Category(
        ("breathable", "lightweight", "waterproof", "slip on", "memory foam", "non slip", "leather"),
        {"color": ("white", "black", "grey", "blue"), "size": ("7", "8", "9", "10", "11")},
        (30, 140),
    ),
    "lamp": Category(
        ("led", "dimmable", "usb charging", "touch control", "adjustable", "wireless", "energy efficient"),
        {"color": ("white", "black", "silver", "gold")},
        (15, 90),
    ),
    "water bottle": Category(
        ("stainless steel", "insulated", "leak proof", "bpa free", "lightweight", "straw lid", "wide mouth"),
        {"color": ("black", "blue", "green", "pink", "white"), "capacity": ("500 ml", "750 ml", "1 l")},
        (10, 45),
    ),
    "notebook": Category(
        ("hardcover", "leather", "dotted", "ruled", "spiral bound", "recycled paper", "waterproof"),
        {"color": ("black", "brown", "blue", "red"), "size": ("a5", "a4")},
        (5, 30),
    ),
    "desk chair": Category(
        ("ergonomic", "adjustable", "leather", "mesh", "lumbar support", "swivel", "memory foam"),
        {"color": ("black", "grey", "white", "blue")},
        (60, 300),
    ),
    "blanket": Category(
        ("cotton", "fleece", "weighted", "machine washable", "hypoallergenic", "lightweight", "soft"),
        {"color": ("grey", "blue", "white", "beige", "green"), "size": ("twin", "queen", "king")},
        (20, 120),
    ),
    "phone case": Category(
        ("shockproof", "slim", "waterproof", "leather", "magnetic", "clear", "kickstand"),
        {"color": ("black", "blue", "pink", "green", "red"), "model": ("iphone 14", "iphone 15", "pixel 8")},
        (8, 40),
    ),
}
BRANDS = (
    "zorvex", "kelto", "lumora", "brisk", "nuvani", "ostra", "pellix", "quenby", "rivolt", "sandor",
    "tavio", "ulmer", "vextra", "wrenly", "yarrow", "zephyn", "alcor", "bexley", "corvo", "dunmore",
)  # fmt: skip
PER_CATEGORY = 30
CENTS = (0.49, 0.95, 0.99)
RESULTS_SHOWN = 5
QUERY_CHARS = 60
OTHER_CATEGORY_WEIGHT = 0.1  # r_type for a product of another category than the goal's
OPENERS = ("i need", "i am looking for", "i want")
HELDOUT_FRACTION = 0.2
DEFAULT_SLACK = 2
SPLITS = ("train", "test")
REQUIRED_FIELDS = ("category", "attributes", "options", "price_limit", "budget")
BACK, PREV, BUY = "click[back to search]", "click[< prev]", "click[buy now]"
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")
_ACTION = re.compile(r"(search|click)\[\s*([^\]]*?)\s*\]")


@dataclass(frozen=True)
class Product:
    id: str
    category: str
    title: str
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]]  # group -> the values this product offers, in vocabulary order
    price: float


@dataclass(frozen=True)
class Goal:
    """What an instruction asks for: a category, attributes, one value per named option group, and a
    price limit."""

    category: str
    attributes: tuple[str, ...]
    options: dict[str, str]
    price_limit: float

    def text(self, variant: int = 0) -> str:
        """WebShop's wording (``variant`` picks the opener)."""
        first = (*self.attributes, self.category)[0]
        article = "an" if first[0] in "aeio" else "a"  # "a usb charging lamp"
        if self.category in ("headphones", "sneakers"):
            article = "a pair of"
        words = [OPENERS[variant], article, ", ".join(self.attributes), self.category]
        text = " ".join(w for w in words if w)
        for group, value in self.options.items():
            text += f" in {value}" if group == "color" else f", {group} {value}"
        return f"{text}, and price lower than {self.price_limit:.2f} dollars"


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


@functools.cache
def catalog() -> tuple[Product, ...]:
    """Every product, in id order; the same for every seed (see the module docstring)."""
    rng = random.Random("shop-catalog")
    drafts = []
    for name, category in CATEGORIES.items():
        low, high = category.price
        for _ in range(PER_CATEGORY):
            attributes = tuple(rng.sample(category.attributes, rng.randint(3, 4)))
            shown = " ".join(attributes[: rng.randint(1, 2)])
            options = {}
            for group, values in category.options.items():
                offered = set(rng.sample(values, rng.randint(2, len(values))))
                options[group] = tuple(v for v in values if v in offered)
            price = rng.randint(low, high - 1) + rng.choice(CENTS)
            drafts.append((name, f"{rng.choice(BRANDS)} {shown} {name}", attributes, options, price))
    rng.shuffle(drafts)
    return tuple(Product(f"p{i:03d}", *draft) for i, draft in enumerate(drafts))


@functools.cache
def _index() -> tuple[list[Counter[str]], list[int], dict[str, float], float]:
    """BM25's statistics of the catalog: each product's term counts and length, each term's idf,
    the mean length. A product's text is its title and its attributes."""
    counts = [Counter(_words(p.title + " " + " ".join(p.attributes))) for p in catalog()]
    lengths = [sum(c.values()) for c in counts]
    frequency = Counter(term for c in counts for term in c)
    n = len(counts)
    idf = {t: math.log(1 + (n - df + 0.5) / (df + 0.5)) for t, df in frequency.items()}
    return counts, lengths, idf, sum(lengths) / n


@functools.lru_cache(maxsize=4096)
def search(query: str, k1: float = 1.2, b: float = 0.75) -> tuple[Product, ...]:
    """The top ``RESULTS_SHOWN`` products for ``query`` by BM25 (Robertson & Zaragoza 2009), each
    query word counted once; ties go to the lower id; products that match no word are left out."""
    counts, lengths, idf, mean_length = _index()
    terms = set(_words(query)) & set(idf)
    scored = []
    for i, (count, length) in enumerate(zip(counts, lengths, strict=True)):
        norm = k1 * (1 - b + b * length / mean_length)
        score = sum(idf[t] * count[t] * (k1 + 1) / (count[t] + norm) for t in terms if t in count)
        if score > 0:
            scored.append((-score, i))
    return tuple(catalog()[i] for _, i in sorted(scored)[:RESULTS_SHOWN])


def satisfies(product: Product, goal: Goal) -> bool:
    """The product is of the goal's category, has its attributes, offers its option values and costs
    no more than its limit: buying it with the goal's options chosen scores 1."""
    return (
        product.category == goal.category
        and set(goal.attributes) <= set(product.attributes)
        and all(v in product.options.get(g, ()) for g, v in goal.options.items())
        and product.price <= goal.price_limit
    )


def purchase_reward(goal: Goal, product: Product, chosen: Mapping[str, str]) -> float:
    """The reward of buying ``product`` with the ``chosen`` options (group -> value): the module
    docstring's simplification of WebShop's eq. 1."""
    r_type = 1.0 if product.category == goal.category else OTHER_CATEGORY_WEIGHT
    matched = (
        len(set(goal.attributes) & set(product.attributes))
        + sum(chosen.get(g) == v for g, v in goal.options.items())
        + (product.price <= goal.price_limit)
    )
    return r_type * matched / (len(goal.attributes) + len(goal.options) + 1)


@dataclass
class Shop:
    """The state of one episode: the page shown, the last query's results, the item open, the
    options chosen on it, and what was bought.

    ``admissible()`` lists the click actions that do something here (``search[...]`` is admissible
    on the search page only, with any query); ``apply(action)`` performs one and returns its
    feedback (``Nothing happens.`` for an action not admissible, with ``False``).
    """

    goal: Goal
    page: str = "search"  # "search", "results" or "item"
    query: str = ""
    results: tuple[Product, ...] = ()
    item: Product | None = None
    chosen: dict[str, str] = field(default_factory=dict)
    bought: Product | None = None

    def admissible(self) -> list[str]:
        if self.page == "results":
            return [BACK] + [f"click[{p.id}]" for p in self.results]
        if self.page == "item":
            assert self.item is not None  # an item page shows an item
            values = [f"click[{v}]" for vs in self.item.options.values() for v in vs]
            return [BACK, PREV, BUY, *values]
        return []

    def listing(self) -> list[str]:
        """The admissible actions as the prompt lists them: numbered, a product with its title and
        price, an option value with its group; on the search page the search action unnumbered."""
        if self.page == "search":
            return ["search[<your query>]"]
        notes = [""]
        if self.page == "results":
            notes += [f" - {p.title}, ${p.price:.2f}" for p in self.results]
        else:
            assert self.item is not None
            notes += ["", ""] + [f" - {g}" for g, vs in self.item.options.items() for _ in vs]
        return [
            f"{i}. {a}{note}" for i, (a, note) in enumerate(zip(self.admissible(), notes, strict=True), 1)
        ]

    def page_text(self) -> str:
        if self.page == "search":
            return "Page: search."
        if self.page == "results":
            return f'Page: results for "{self.query}".' + ("" if self.results else " No results.")
        item = self.item
        assert item is not None
        chosen = ", ".join(f"{g} {v}" for g, v in self.chosen.items()) or "none"
        return (
            f"Page: item {item.id}: {item.title}, ${item.price:.2f}.\n"
            f"Attributes: {', '.join(item.attributes)}.\nSelected: {chosen}."
        )

    def apply(self, action: str) -> tuple[str, bool]:
        """Perform ``action`` when admissible: (feedback, True); else (``Nothing happens.``, False)."""
        match = _ACTION.fullmatch(action)
        if match and match[1] == "search" and self.page == "search" and _words(match[2][:QUERY_CHARS]):
            self.query = " ".join(match[2][:QUERY_CHARS].split())
            self.results, self.page = search(self.query), "results"
            return f"You search for {self.query}: {len(self.results)} results.", True
        if action not in self.admissible():
            return "Nothing happens.", False
        if action == BACK:
            self.page, self.item = "search", None
            return "You go back to search.", True
        if action == PREV:
            self.page, self.item = "results", None
            return "You go back to the results.", True
        if action == BUY:
            self.bought = self.item
            return "You buy the item.", True
        value = match[2] if match else ""
        if self.page == "results":
            self.item = next(p for p in self.results if p.id == value)
            self.page, self.chosen = "item", {}
            return f"You open {value}.", True
        assert self.item is not None
        group = next(g for g, vs in self.item.options.items() if value in vs)
        self.chosen[group] = value
        return f"You select {value} ({group}).", True

    def state_text(self) -> str:
        """The page, and on an item page the item and the options chosen (``info["state"]``)."""
        if self.page == "item" and self.item is not None:
            return f"item {self.item.id}|" + ",".join(self.chosen.values())
        return self.page


def parse_action(text: str) -> str:
    """The action in a response: end-of-turn markers removed, whitespace collapsed, lower case; a
    leading ``search[...]`` or ``click[...]`` is kept alone (a copied listing line's title goes)."""
    for marker in _END_MARKERS:
        text = text.replace(marker, "")
    text = " ".join(text.split()).lower()
    match = _ACTION.match(text)
    return f"{match[1]}[{match[2]}]" if match else text


def chosen_action(shop: Shop, response: str) -> str:
    """The action a parsed response names (``listed_action`` over the admissible actions)."""
    return listed_action(shop.admissible(), response)


def shop_of(task: Mapping[str, Any]) -> tuple[Shop, int]:
    """A fresh ``Shop`` for a task row, and its budget; a row without a field, or one that does not
    describe a solvable task, raises ``ValueError`` naming the row and the field."""
    where = f"shop task {task.get('id', '(no id)')!r}"
    for name in REQUIRED_FIELDS:
        if name not in task:
            raise ValueError(f"{where}: missing field {name!r} (rows need {', '.join(REQUIRED_FIELDS)})")
    name = task["category"]
    if name not in CATEGORIES:
        raise ValueError(f"{where}: 'category' {name!r} is not one of {', '.join(CATEGORIES)}")
    category = CATEGORIES[name]
    attributes, options = task["attributes"], task["options"]
    if not isinstance(attributes, list | tuple) or not all(a in category.attributes for a in attributes):
        raise ValueError(
            f"{where}: 'attributes' must be a list of {name!r} attributes: {', '.join(category.attributes)}"
        )
    if not isinstance(options, Mapping) or not all(
        v in category.options.get(g, ()) for g, v in options.items()
    ):
        groups = "; ".join(f"{g}: {', '.join(vs)}" for g, vs in category.options.items())
        raise ValueError(f"{where}: 'options' must map {name!r} option groups to a value ({groups})")
    limit = task["price_limit"]
    if isinstance(limit, bool) or not isinstance(limit, int | float) or limit <= 0:
        raise ValueError(f"{where}: 'price_limit' must be a positive number, got {limit!r}")
    budget = task["budget"]
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"{where}: 'budget' must be an integer, got {budget!r}")
    goal = Goal(name, tuple(attributes), dict(options), float(limit))
    if not any(satisfies(p, goal) for p in catalog()):
        raise ValueError(f"{where}: no product in the catalog satisfies {goal.text()!r}: unsolvable")
    shortest = _shortest(goal)
    if budget < shortest:
        raise ValueError(f"{where}: 'budget' {budget} is below the shortest solution ({shortest} actions)")
    return Shop(goal), budget


def _shortest(goal: Goal) -> int:
    return 3 + len(goal.options)  # search, click the product, one click per option, buy


QUERIES = ("goal", "category")


def _check_query(query: str) -> None:
    if query not in QUERIES:
        raise ValueError(f"shop: query must be one of {', '.join(QUERIES)}, got {query!r}")


def demonstrator_query(goal: Goal, query: str = "goal") -> str:
    """The demonstrator's query: the goal's attributes and category (``"goal"``), or the category
    alone (``"category"``: one of 12 strings, for a model that cannot copy words out of the
    instruction)."""
    _check_query(query)
    return goal.category if query == "category" else " ".join((*goal.attributes, goal.category))


def _offered(goal: Goal, product: Product) -> dict[str, str]:
    """The goal's options that ``product`` offers (group -> value)."""
    return {g: v for g, v in goal.options.items() if v in product.options.get(g, ())}


def _next_action(shop: Shop, *, forget_last_option: bool, query: str = "goal") -> str | None:
    """The next action of the demonstrator's solution from ``shop``, skipping the goal's last option
    when ``forget_last_option``. On a results page it clicks the first product that satisfies the
    goal, or when none is listed (possible for a ``"category"`` query) the listed product whose
    purchase, with the goal's options it offers, is worth most (None when nothing is listed)."""
    goal = shop.goal
    if shop.page == "search":
        return f"search[{demonstrator_query(goal, query)}]"
    if shop.page == "results":
        right = [p for p in shop.results if satisfies(p, goal)]
        if not right:
            right = sorted(shop.results, key=lambda p: -purchase_reward(goal, p, _offered(goal, p)))
        return f"click[{right[0].id}]" if right else None
    assert shop.item is not None
    wanted = list(_offered(goal, shop.item).items())
    wanted = wanted[: len(wanted) - forget_last_option]
    missing = [v for g, v in wanted if shop.chosen.get(g) != v]
    return f"click[{missing[0]}]" if missing else BUY


class ShopEnv(AgentEnv):
    """One episode of a shop task (a ``make_dataset`` row; see the module docstring).

    Each observation is the system prompt and one user message rewritten from the state: the
    instruction, the page, the last feedback and the admissible actions, one per line. Buying
    terminates the episode with outcome ``purchase_reward`` (``success`` when it is 1.0); the budget
    spent truncates it with 0.0. Every step's ``info`` holds ``state`` (the page, and on an item page
    the item and the options chosen), ``action`` (the parsed response) and ``invalid``; the last one
    ``success`` too.
    """

    required_fields = REQUIRED_FIELDS
    task_fields = ("id", "goal", "target", *REQUIRED_FIELDS)

    def __init__(self, max_turns: int | None = None) -> None:
        self.max_turns = max_turns

    async def reset(self, task: Mapping[str, Any]) -> Observation:
        self.shop, self.budget = shop_of(task)
        if self.max_turns is not None:
            self.budget = min(self.budget, self.max_turns)
        self.instruction = task.get("goal") or self.shop.goal.text()
        self.actions = 0
        return self._observation("You are on the search page.")

    def _observation(self, feedback: str) -> Observation:
        actions = "\n".join(self.shop.listing())
        text = f"Instruction: {self.instruction}\n{self.shop.page_text()}\n> {feedback}\nActions:\n{actions}"
        return Observation(
            messages=({"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text})
        )

    async def step(self, action: Action) -> StepResult:
        state = self.shop.state_text()
        command = chosen_action(self.shop, parse_action(action.text))
        feedback, valid = self.shop.apply(command)
        self.actions += 1
        info: dict[str, Any] = {"state": state, "action": command, "invalid": not valid}
        if self.shop.bought is not None:
            reward = purchase_reward(self.shop.goal, self.shop.bought, self.shop.chosen)
            return StepResult(
                None, terminated=True, outcome_reward=reward, info={**info, "success": reward == 1.0}
            )
        if self.actions >= self.budget:
            return out_of_budget(info)
        return StepResult(self._observation(feedback), info=info)


def make_env(tokenizer: Any = None, *, max_turns: int | None = None, **kwargs: Any) -> ShopEnv:
    """A ``ShopEnv`` (it renders no template of its own, so ``tokenizer`` goes unused).
    ``max_turns``: a cap on every episode's actions below the row's budget (None: the budget alone).

    Usable as ``env.name: agent_r1.tasks.shop:make_env`` in a training config."""
    check_env_arguments("shop", max_turns, kwargs)
    return ShopEnv(max_turns)


make_env.required_fields = REQUIRED_FIELDS  # type: ignore[attr-defined]  # checked at data load


def _is_heldout(key: str) -> bool:
    return hashlib.sha256(key.encode()).digest()[0] < 256 * HELDOUT_FRACTION


def _draw_goal(rng: random.Random) -> Goal:
    """A goal drawn from one product: 1-2 of its attributes, a value in 1-2 of its option groups, a
    price limit 10-30 dollars above its price rounded down to ten."""
    product = rng.choice(catalog())
    attributes = set(rng.sample(product.attributes, rng.randint(1, 2)))
    groups = set(rng.sample(list(product.options), rng.randint(1, len(product.options))))
    return Goal(
        product.category,
        tuple(a for a in product.attributes if a in attributes),
        {g: rng.choice(vs) for g, vs in product.options.items() if g in groups},
        float(10 * (int(product.price // 10) + rng.randint(1, 3))),
    )


def make_dataset(
    n: int | None = 100, *, split: str = "train", seed: int = 0, slack: int = DEFAULT_SLACK
) -> list[dict[str, Any]]:
    """``n`` task rows of ``split`` (``"train"`` or ``"test"``: disjoint goals), reproducible from
    ``seed``.

    Each row: ``id``, ``goal`` (the instruction in WebShop's wording), ``category``, ``attributes``,
    ``options`` (group -> value), ``price_limit``, ``target`` (the first product the demonstrator's
    search lists that satisfies the goal; a goal whose search lists none is not drawn) and
    ``budget`` (the shortest solution's length plus ``slack``). ``n=None`` gives 100.
    """
    if split not in SPLITS:
        raise ValueError(f"shop: split must be one of {', '.join(SPLITS)}, got {split!r}")
    if slack < 0:
        raise ValueError(f"shop: slack must be >= 0 (actions beyond the shortest solution), got {slack}")
    n = 100 if n is None else n
    if n < 1:
        raise ValueError(f"shop: n must be >= 1, got {n}")
    rng = random.Random(f"shop-{split}-{seed}")
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        goal = _draw_goal(rng)
        variant = rng.randrange(len(OPENERS))
        key = repr((goal.category, goal.attributes, sorted(goal.options.items()), goal.price_limit))
        if _is_heldout(key) != (split == "test"):
            continue
        right = [p for p in search(demonstrator_query(goal)) if satisfies(p, goal)]
        if not right:
            continue
        rows.append(
            {
                "id": f"{split}-{seed}-{len(rows)}",
                "goal": goal.text(variant),
                "category": goal.category,
                "attributes": list(goal.attributes),
                "options": dict(goal.options),
                "price_limit": goal.price_limit,
                "target": right[0].id,
                "budget": _shortest(goal) + slack,
            }
        )
    return rows


def demonstrate(
    task: Mapping[str, Any],
    rng: random.Random,
    *,
    error_rate: float = 0.5,
    numbered: bool = False,
    query: str = "goal",
    options_by_text: bool = False,
) -> list[str]:
    """The actions of one demonstration, played to the episode's end (a purchase or out of budget).

    Search with the goal's attributes and category, click the first result that satisfies the goal,
    select each goal option and buy, except that with probability ``error_rate`` it forgets the last
    option and buys one click early. See the module docstring. ``numbered``: each click is answered
    by its number in the listed actions instead of its text (the search stays text). ``query``: what
    it searches for (``demonstrator_query``). ``options_by_text``: with ``numbered``, an option is
    still clicked by its value (``click[blue]``: a word of the instruction, where its number is a
    look-up in the list).
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"shop: error_rate must be in [0, 1], got {error_rate}")
    _check_query(query)
    shop, budget = shop_of(task)
    forget = rng.random() < error_rate
    actions: list[str] = []
    while shop.bought is None and len(actions) < budget:
        action = _next_action(shop, forget_last_option=forget, query=query)
        if action is None:
            break
        admissible = shop.admissible()
        option = shop.page == "item" and action not in (BACK, PREV, BUY)
        by_number = numbered and action in admissible and not (options_by_text and option)
        listed = str(admissible.index(action) + 1) if by_number else action
        shop.apply(action)
        actions.append(listed)
    return actions


def build_task(
    *, numbered: bool = False, error_rate: float = 0.5, query: str = "goal", options_by_text: bool = False
):
    """The ``shop`` entry of ``agent_r1.tasks.TASKS``: an ``AgentEnv`` task (no tools; the env reads
    the response as one action, its text or a click's number in the list, and rewards the
    purchase). ``numbered``: the demonstrator answers clicks with numbers (one token instead of
    copying ~15 characters); ``error_rate``: its habit's rate; ``query``: what it searches for
    (``demonstrator_query``); ``options_by_text``: options clicked by their value even when
    ``numbered`` (``demonstrate``)."""
    from agent_r1.tasks import TaskSpec

    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"shop: error_rate must be in [0, 1], got {error_rate}")
    _check_query(query)

    most_options = max(len(c.options) for c in CATEGORIES.values())
    return TaskSpec(
        name="shop",
        make_dataset=make_dataset,
        tools=list,
        tool_format=lambda: None,
        extract_answer=parse_action,
        reward=lambda answer, task: 0.0,  # the env rewards the purchase; no answer is scored apart
        demonstrate=functools.partial(
            demonstrate,
            error_rate=error_rate,
            numbered=numbered,
            query=query,
            options_by_text=options_by_text,
        ),
        max_turns=3 + most_options + DEFAULT_SLACK,
        make_env=make_env,
        required_fields=REQUIRED_FIELDS,
    )
