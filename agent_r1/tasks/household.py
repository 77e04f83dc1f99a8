"""Household: an ALFWorld-like embodied text task (Shridhar et al. 2021, arXiv 2010.03768), built
here procedurally.

ALFWorld's own games come from TextWorld, which compiles each game (Inform 7) and downloads the
ALFRED scenes; neither runs offline from PyPI alone, so this module generates rooms of its own with
ALFWorld's text interface:

- **A room** holds numbered receptacles (``countertop 1``, ``cabinet 1``..``cabinet k``,
  ``drawer 1``..``k``, ``fridge 1``, ``microwave 1``, ``sinkbasin 1``, ``coffeemachine 1``,
  ``shelf``, ``desk 1`` with ``desklamp 1`` on it, ``garbagecan 1``, ``diningtable 1``); cabinets,
  drawers, the fridge and the microwave start closed. Two or three objects lie in the receptacles.
- **Actions** are ALFWorld's: ``go to X``, ``open X``, ``close X``, ``take OBJ from X``, ``put OBJ
  in/on X``, ``clean OBJ with sinkbasin 1``, ``heat OBJ with microwave 1``, ``cool OBJ with fridge
  1``, ``use desklamp 1``. One object is held at a time; a closed receptacle must be opened before
  anything is taken from it or put in it. Anything not admissible answers ``Nothing happens.`` and
  costs its step (``info["invalid"]``).
- **Goals** are ALFWorld's five task types in its wording: ``put a mug in cabinet.``
  (pick_and_place), ``put a clean mug in coffeemachine.`` / ``clean some mug and put it in ...``
  (pick_clean_then_place), the same with hot / heat (microwave) and cool (fridge), and ``examine the
  book with the desklamp.`` (look_at_obj_in_light: hold it and use the lamp). A put goal names a
  receptacle type: any instance satisfies it.
- **Splits.** Layouts are generated from their index; a hash of the index makes about a quarter of
  them *unseen*. ``split="train"`` and ``split="test"`` draw from the seen layouts, told apart by a
  hash of the task (layout, goal, where the object lies): ALFWorld's train and valid_seen.
  ``split="unseen"`` draws from the unseen layouts only (other receptacle sets and numbering):
  ALFWorld's valid_unseen.

Deviations from ALFWorld, each for the project's 1M-parameter byte-level model (every character a
token, 2,048 positions):

- **The room is fully observed.** ALFWorld hides what closed receptacles hold and the agent
  searches; here the prompt lists where every object lies (``mug 1 in cabinet 2``), so an optimal
  episode is 4-8 actions and the budget is that plus ``slack`` (2), as gridwalk's.
- **The env chooses the context** (docs/environments.md, "Context policies"): each turn's prompt is
  rewritten from the state (the goal, where the agent is, what it holds and in what state, where
  the objects lie, the last feedback, the admissible actions), so a prompt stays under ~700
  characters whatever the episode's length, and the policy chooses by copying one listed action.
- **Admissible actions are only the useful ones**: those at the current receptacle and ``go to``
  each other receptacle; ALFWorld's ``look``, ``inventory`` and ``examine`` are left out (the state
  is in the prompt already). ``heat``/``cool`` need no open microwave or fridge (as in ALFWorld).

The demonstrator (``demonstrate``) plays the shortest solution, with one *systematic* habit: on the
clean / heat / cool tasks it skips the processing with probability ``error_rate`` and carries the
object straight to the target. The put does not satisfy the goal, and its recovery (take it back,
process it, put it again) needs more than the two actions of slack, so such an episode fails. The
habit is made at one state (holding the unprocessed object, away from the appliance), which a
model cloned from it repeats and RL can fix. About 70% of the tasks need processing, so its success
rate is about ``1 - 0.7 * error_rate``: 0.66 at the default 0.5, 0.73 at 0.4 (1,000 train tasks).

**Not yet learnable by the tiny model at a quickstart-sized warm start.** After 800 demonstrations
(error_rate 0.4) x 2 epochs (SFT loss 5.6 -> 0.16), held-out success sampled at T=1 was 0.00 on
``test`` and ``unseen`` (100 tasks each). Greedy along the optimal path, the verb of the next action
is right about 60% of the time but the whole action only 15%: the model does not copy the right
object and receptacle names out of a ~400-character prompt. Answering by number (``numbered``)
does not help: after the same warm start (800 numbered demonstrations x 2 epochs, 2026-12-07) the
model answers the most frequent numbers (``2``, ``1``) whatever the room, success 0.00 on both
splits. The right number is three look-ups away (the goal's object, where ``Seen`` says it lies,
the line that goes there), which the tiny model does not learn at this budget. A pretrained model
reads it; on this machine a SmolLM2 run of the table's size would take hours
(docs/paper_table.md).
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent_r1.envs.base import AgentEnv
from agent_r1.tasks.listed_actions import check_env_arguments, listed_action, out_of_budget
from agent_r1.types import Action, Observation, StepResult

__all__ = [
    "SYSTEM_PROMPT",
    "TASK_TYPES",
    "HouseholdEnv",
    "Room",
    "build_task",
    "chosen_action",
    "demonstrate",
    "layout",
    "make_dataset",
    "make_env",
    "parse_action",
    "split_layouts",
]

SYSTEM_PROMPT = "Reply with one action from the list."
TASK_TYPES = (
    "pick_and_place",
    "pick_clean_then_place",
    "pick_heat_then_place",
    "pick_cool_then_place",
    "look_at_obj_in_light",
)
# The processing a task type needs: (verb, appliance, the state word the held object shows after it).
PROCESSING = {
    "pick_clean_then_place": ("clean", "sinkbasin 1", "clean"),
    "pick_heat_then_place": ("heat", "microwave 1", "hot"),
    "pick_cool_then_place": ("cool", "fridge 1", "cool"),
}
GOAL_TEMPLATES = {
    "pick_and_place": ("put a {obj} in {target}.", "put some {obj} on {target}."),
    "pick_clean_then_place": ("put a clean {obj} in {target}.", "clean some {obj} and put it in {target}."),
    "pick_heat_then_place": ("put a hot {obj} in {target}.", "heat some {obj} and put it in {target}."),
    "pick_cool_then_place": ("put a cool {obj} in {target}.", "cool some {obj} and put it in {target}."),
    "look_at_obj_in_light": ("examine the {obj} with the desklamp.", "look at {obj} under the desklamp."),
}
# Objects each task type may ask for (ALFWorld's usual ones).
OBJECTS = {
    "pick_and_place": ("mug", "apple", "book", "plate", "pen", "cd", "potato", "egg"),
    "pick_clean_then_place": ("mug", "plate", "apple", "potato"),
    "pick_heat_then_place": ("mug", "apple", "potato", "egg"),
    "pick_cool_then_place": ("mug", "apple", "potato", "egg"),
    "look_at_obj_in_light": ("book", "cd", "pen"),
}
# Receptacle types a put goal may name, and the ones closed until opened.
TARGETS = ("countertop", "cabinet", "drawer", "shelf", "fridge", "coffeemachine", "diningtable", "garbagecan")
CLOSABLE = ("cabinet", "drawer", "fridge", "microwave")
LAYOUT_COUNT = 40
UNSEEN_FRACTION = 0.25
HELDOUT_FRACTION = 0.2
DEFAULT_SLACK = 2
SPLITS = ("train", "test", "unseen")
REQUIRED_FIELDS = ("receptacles", "objects", "task_type", "object", "target", "budget")
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")


def layout(index: int) -> list[str]:
    """The receptacles of layout ``index``, in the room's order (the order of its ``go to`` list).

    Every room is a kitchen (countertop, fridge, microwave, sinkbasin) with 0-3 cabinets and drawers
    and some of a coffeemachine, shelves, a desk (with its desklamp), a diningtable, a garbagecan.
    """
    rng = random.Random(f"household-layout-{index}")
    counts = {
        "countertop": rng.randint(1, 2),
        "cabinet": rng.randint(0, 2),
        "drawer": rng.randint(0, 2),
        "fridge": 1,
        "microwave": 1,
        "sinkbasin": 1,
        "coffeemachine": rng.randint(0, 1),
        "shelf": rng.randint(0, 1),
        "desk": rng.randint(0, 1),
        "diningtable": rng.randint(0, 1),
        "garbagecan": rng.randint(0, 1),
    }
    receptacles = [f"{kind} {i}" for kind, n in counts.items() for i in range(1, n + 1)]
    rng.shuffle(receptacles)
    return receptacles


def _is_unseen_layout(index: int) -> bool:
    return hashlib.sha256(f"household layout {index}".encode()).digest()[0] < 256 * UNSEEN_FRACTION


def split_layouts(split: str) -> list[int]:
    """The layout indices of ``split``: the seen ones for ``"train"`` and ``"test"``, the unseen
    ones for ``"unseen"``; a layout whose receptacles repeat an earlier one's is dropped."""
    if split not in SPLITS:
        raise ValueError(f"household: split must be one of {', '.join(SPLITS)}, got {split!r}")
    kept: list[int] = []
    rooms: set[tuple[str, ...]] = set()
    for index in range(LAYOUT_COUNT):
        room = tuple(sorted(layout(index)))
        if room in rooms:
            continue
        rooms.add(room)
        if _is_unseen_layout(index) == (split == "unseen"):
            kept.append(index)
    return kept


def _kind(receptacle: str) -> str:
    return receptacle.rsplit(" ", 1)[0]


@dataclass
class Room:
    """The state of one episode: where things are, what the agent holds, and the goal.

    ``admissible()`` lists the actions that do something here; ``apply(action)`` performs one and
    returns ALFWorld's feedback (``Nothing happens.`` for an action not admissible, with ``False``).
    """

    receptacles: list[str]
    objects: dict[str, str]  # object -> receptacle ("" while held)
    task_type: str
    target_object: str  # an object type: "mug"
    target: str  # a receptacle type for a put goal; "desklamp" for look_at_obj_in_light
    location: str | None = None
    holding: str | None = None
    opened: set[str] = field(default_factory=set)
    states: dict[str, set[str]] = field(default_factory=dict)  # object -> {"clean", "hot", "cool"}
    lamp_on_with: str | None = None  # the object held when the desklamp was used

    def is_open(self, receptacle: str) -> bool:
        return _kind(receptacle) not in CLOSABLE or receptacle in self.opened

    def goal_text(self) -> str:
        return goal_text(self.task_type, self.target_object, self.target, variant=0)

    def admissible(self) -> list[str]:
        here: list[str] = []
        at = self.location
        if at is not None:
            if _kind(at) in CLOSABLE:
                here.append(f"close {at}" if at in self.opened else f"open {at}")
            if self.is_open(at) and self.holding is None:
                here += [
                    f"take {o} from {at}"
                    for o, r in self.objects.items()
                    if r == at and _kind(o) != "desklamp"
                ]
            if self.holding is not None:
                if self.is_open(at):
                    here.append(f"put {self.holding} in/on {at}")
                for verb, appliance, _ in PROCESSING.values():
                    if at == appliance:
                        here.append(f"{verb} {self.holding} with {at}")
            if any(r == at and _kind(o) == "desklamp" for o, r in self.objects.items()):
                here.append("use desklamp 1")
        return here + [f"go to {r}" for r in self.receptacles if r != at]

    def apply(self, action: str) -> tuple[str, bool]:
        """Perform ``action`` when admissible: (feedback, True); else (``Nothing happens.``, False)."""
        if action not in self.admissible():
            return "Nothing happens.", False
        verb, _, rest = action.partition(" ")
        if verb == "go":
            self.location = rest.removeprefix("to ")
            return f"You arrive at {self.location}.", True
        if verb == "open":
            self.opened.add(rest)
            return f"You open the {rest}.", True
        if verb == "close":
            self.opened.discard(rest)
            return f"You close the {rest}.", True
        if verb == "take":
            obj = rest.split(" from ")[0]
            self.objects[obj], self.holding = "", obj
            return f"You pick up the {obj} from the {self.location}.", True
        if verb == "put":
            obj = self.holding
            assert obj is not None and self.location is not None  # admissible() checked
            self.objects[obj], self.holding = self.location, None
            return f"You put the {obj} in/on the {self.location}.", True
        if verb == "use":
            self.lamp_on_with = self.holding
            return "You turn on the desklamp 1.", True
        obj = rest.split(" with ")[0]  # clean / heat / cool
        state = {"clean": "clean", "heat": "hot", "cool": "cool"}[verb]
        states = self.states.setdefault(obj, set())
        if state != "clean":
            states -= {"hot", "cool"}  # heating undoes cooling and the other way round
        states.add(state)
        return f"You {verb} the {obj} using the {self.location}.", True

    def needed_state(self) -> str | None:
        """The state word a put goal asks of its object (``clean``, ``hot``, ``cool``), or None."""
        return PROCESSING[self.task_type][2] if self.task_type in PROCESSING else None

    def satisfied(self) -> bool:
        if self.task_type == "look_at_obj_in_light":
            return self.lamp_on_with is not None and _kind(self.lamp_on_with) == self.target_object
        needed = self.needed_state()
        return any(
            _kind(o) == self.target_object
            and r
            and _kind(r) == self.target
            and (needed is None or needed in self.states.get(o, set()))
            for o, r in self.objects.items()
        )

    def state_text(self) -> str:
        """The compact state: where the agent is, what it holds (and its state), where objects lie."""
        held = "nothing"
        if self.holding is not None:
            words = sorted(self.states.get(self.holding, set()))
            held = self.holding + (f" ({', '.join(words)})" if words else "")
        lying = ", ".join(f"{o} in {r}" for o, r in self.objects.items() if r and _kind(o) != "desklamp")
        return f"At: {self.location or 'the middle of the room'}. Holding: {held}.\nSeen: {lying}."


def goal_text(task_type: str, obj: str, target: str, *, variant: int) -> str:
    """ALFWorld's wording of a goal (``variant`` picks one of its two templates)."""
    return GOAL_TEMPLATES[task_type][variant].format(obj=obj, target=target)


def parse_action(text: str) -> str:
    """The action in a response: end-of-turn markers removed, whitespace collapsed, lower case."""
    for marker in _END_MARKERS:
        text = text.replace(marker, "")
    return " ".join(text.split()).lower()


def chosen_action(room: Room, response: str) -> str:
    """The action a parsed response names (``listed_action`` over the admissible actions)."""
    return listed_action(room.admissible(), response)


def room_of(task: Mapping[str, Any]) -> tuple[Room, int]:
    """A fresh ``Room`` for a task row, and its budget; a row without a field, or one that does not
    describe a solvable task, raises ``ValueError`` naming the row and the field."""
    where = f"household task {task.get('id', '(no id)')!r}"
    for name in REQUIRED_FIELDS:
        if name not in task:
            raise ValueError(f"{where}: missing field {name!r} (rows need {', '.join(REQUIRED_FIELDS)})")
    receptacles, objects = task["receptacles"], task["objects"]
    if not isinstance(receptacles, list) or not all(isinstance(r, str) for r in receptacles):
        raise ValueError(f"{where}: 'receptacles' must be a list of names such as 'cabinet 1'")
    if not isinstance(objects, Mapping) or not all(r in receptacles for r in objects.values()):
        raise ValueError(f"{where}: 'objects' must map each object to one of the row's 'receptacles'")
    if task["task_type"] not in TASK_TYPES:
        raise ValueError(f"{where}: 'task_type' {task['task_type']!r} is not one of {', '.join(TASK_TYPES)}")
    budget = task["budget"]
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"{where}: 'budget' must be an integer, got {budget!r}")
    room = Room(list(receptacles), dict(objects), task["task_type"], task["object"], task["target"])
    shortest = len(_plan(room, skip_processing=False))
    if shortest == 0:
        raise ValueError(
            f"{where}: 'object' {task['object']!r} / 'target' {task['target']!r}: unsolvable here"
        )
    if budget < shortest:
        raise ValueError(f"{where}: 'budget' {budget} is below the shortest solution ({shortest} actions)")
    return room, budget


def _next_action(room: Room, *, skip_processing: bool) -> str | None:
    """The next action of the shortest solution from ``room`` (None when there is none), putting the
    object unprocessed when ``skip_processing`` (the demonstrator's habit)."""
    holding_target = room.holding is not None and _kind(room.holding) == room.target_object
    if not holding_target:
        if room.holding is not None:
            return f"put {room.holding} in/on {room.location}" if room.is_open(room.location or "") else None
        sources = [r for o, r in room.objects.items() if _kind(o) == room.target_object and r]
        if not sources:
            return None
        source = sources[0]
        if room.location != source:
            return f"go to {source}"
        if not room.is_open(source):
            return f"open {source}"
        return f"take {next(o for o, r in room.objects.items() if r == source and _kind(o) == room.target_object)} from {source}"
    if room.task_type == "look_at_obj_in_light":
        lamp = room.objects.get("desklamp 1")
        if not lamp:
            return None
        return "use desklamp 1" if room.location == lamp else f"go to {lamp}"
    needed = room.needed_state()
    if (
        needed is not None
        and needed not in room.states.get(room.holding or "", set())
        and not skip_processing
    ):
        verb, appliance, _ = PROCESSING[room.task_type]
        return (
            f"{verb} {room.holding} with {appliance}" if room.location == appliance else f"go to {appliance}"
        )
    targets = [r for r in room.receptacles if _kind(r) == room.target]
    if not targets:
        return None
    target = room.location if room.location in targets else targets[0]
    if room.location != target:
        return f"go to {target}"
    if not room.is_open(target):
        return f"open {target}"
    return f"put {room.holding} in/on {target}"


def _plan(room: Room, *, skip_processing: bool, limit: int = 20) -> list[str]:
    """The actions of the shortest solution played on a copy of ``room`` (empty if it finds none)."""
    room = _copy(room)
    actions: list[str] = []
    while not room.satisfied() and len(actions) < limit:
        action = _next_action(room, skip_processing=skip_processing)
        if action is None:
            return []
        room.apply(action)
        actions.append(action)
    return actions if room.satisfied() else []


def _copy(room: Room) -> Room:
    return Room(
        list(room.receptacles),
        dict(room.objects),
        room.task_type,
        room.target_object,
        room.target,
        room.location,
        room.holding,
        set(room.opened),
        {o: set(s) for o, s in room.states.items()},
        room.lamp_on_with,
    )


class HouseholdEnv(AgentEnv):
    """One episode of a household task (a ``make_dataset`` row; see the module docstring).

    Each observation is the system prompt and one user message rewritten from the state: the goal,
    ``At`` / ``Holding`` / ``Seen``, the last feedback and the admissible actions, one per line. A
    goal satisfied terminates the episode with outcome 1.0; the budget spent truncates it with 0.0.
    Every step's ``info`` holds ``state`` (where the agent was and what it held), ``action`` (the
    parsed response) and ``invalid``; the last one ``success`` too.
    """

    required_fields = REQUIRED_FIELDS
    task_fields = ("id", "layout", "goal", *REQUIRED_FIELDS)

    def __init__(self, max_turns: int | None = None) -> None:
        self.max_turns = max_turns

    async def reset(self, task: Mapping[str, Any]) -> Observation:
        self.room, self.budget = room_of(task)
        if self.max_turns is not None:
            self.budget = min(self.budget, self.max_turns)
        self.goal = task.get("goal") or self.room.goal_text()
        self.actions = 0
        return self._observation("You are in the middle of a room.")

    def _observation(self, feedback: str) -> Observation:
        actions = "\n".join(f"{i}. {a}" for i, a in enumerate(self.room.admissible(), 1))
        text = f"Your task is to: {self.goal}\n{self.room.state_text()}\n> {feedback}\nActions:\n{actions}"
        return Observation(
            messages=({"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text})
        )

    async def step(self, action: Action) -> StepResult:
        state = f"{self.room.location or 'start'}|{self.room.holding or 'nothing'}"
        command = chosen_action(self.room, parse_action(action.text))
        feedback, valid = self.room.apply(command)
        self.actions += 1
        info: dict[str, Any] = {"state": state, "action": command, "invalid": not valid}
        if self.room.satisfied():
            return StepResult(None, terminated=True, outcome_reward=1.0, info={**info, "success": True})
        if self.actions >= self.budget:
            return out_of_budget(info)
        return StepResult(self._observation(feedback), info=info)


def make_env(tokenizer: Any = None, *, max_turns: int | None = None, **kwargs: Any) -> HouseholdEnv:
    """A ``HouseholdEnv`` (it renders no template of its own, so ``tokenizer`` goes unused).
    ``max_turns``: a cap on every episode's actions below the row's budget (None: the budget alone).

    Usable as ``env.name: agent_r1.tasks.household:make_env`` in a training config."""
    check_env_arguments("household", max_turns, kwargs)
    return HouseholdEnv(max_turns)


make_env.required_fields = REQUIRED_FIELDS  # type: ignore[attr-defined]  # checked at data load


def _task_types_for(receptacles: list[str]) -> list[str]:
    kinds = {_kind(r) for r in receptacles}
    return [t for t in TASK_TYPES if t != "look_at_obj_in_light" or "desk" in kinds]


def _is_heldout(key: str) -> bool:
    return hashlib.sha256(key.encode()).digest()[0] < 256 * HELDOUT_FRACTION


def _draw_task(rng: random.Random, index: int) -> dict[str, Any] | None:
    """One task on layout ``index``: a goal, 2-3 objects placed, or None when the draw is unusable."""
    receptacles = layout(index)
    task_type = rng.choice(_task_types_for(receptacles))
    obj = rng.choice(OBJECTS[task_type])
    kinds = {_kind(r) for r in receptacles}
    if task_type == "look_at_obj_in_light":
        target = "desklamp"
    else:
        appliance = PROCESSING[task_type][1] if task_type in PROCESSING else None
        choices = [t for t in TARGETS if t in kinds and (t != "coffeemachine" or obj == "mug")]
        choices = [t for t in choices if appliance is None or t != _kind(appliance)]
        target = rng.choice(choices)
    kinds_of_objects = {obj}
    others = [o for t in OBJECTS.values() for o in t]
    while len(kinds_of_objects) < rng.randint(2, 3):
        kinds_of_objects.add(rng.choice(others))
    holders = [r for r in receptacles if r != "desk 1" or task_type != "look_at_obj_in_light"]
    objects = {f"{kind} 1": rng.choice(holders) for kind in sorted(kinds_of_objects)}
    if _kind(objects[f"{obj} 1"]) == target:
        return None  # already in place: nothing to do for a put goal
    if "desk 1" in receptacles:
        objects["desklamp 1"] = "desk 1"
    items = list(objects.items())
    rng.shuffle(items)
    return {
        "layout": index,
        "receptacles": receptacles,
        "objects": dict(items),
        "task_type": task_type,
        "object": obj,
        "target": target,
        "goal": goal_text(task_type, obj, target, variant=rng.randint(0, 1)),
    }


def make_dataset(
    n: int | None = 100, *, split: str = "train", seed: int = 0, slack: int = DEFAULT_SLACK
) -> list[dict[str, Any]]:
    """``n`` task rows of ``split`` (``"train"``, ``"test"``: seen layouts, disjoint tasks;
    ``"unseen"``: layouts never in train), reproducible from ``seed``.

    Each row: ``id``, ``layout`` (its index), ``receptacles``, ``objects`` (object -> receptacle),
    ``task_type``, ``object``, ``target`` (a receptacle type, or ``desklamp``), ``goal`` (ALFWorld's
    wording) and ``budget`` (the shortest solution's length plus ``slack``). ``n=None`` gives 100.
    """
    if slack < 0:
        raise ValueError(f"household: slack must be >= 0 (actions beyond the shortest solution), got {slack}")
    n = 100 if n is None else n
    if n < 1:
        raise ValueError(f"household: n must be >= 1, got {n}")
    layouts = split_layouts(split)
    rng = random.Random(f"household-{split}-{seed}")
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        row = _draw_task(rng, rng.choice(layouts))
        if row is None:
            continue
        key = repr(
            (
                row["layout"],
                row["task_type"],
                row["object"],
                row["target"],
                row["objects"][f"{row['object']} 1"],
            )
        )
        if split != "unseen" and _is_heldout(key) != (split == "test"):
            continue
        room = Room(row["receptacles"], dict(row["objects"]), row["task_type"], row["object"], row["target"])
        row["budget"] = len(_plan(room, skip_processing=False)) + slack
        rows.append({"id": f"{split}-{seed}-{len(rows)}", **row})
    return rows


def demonstrate(
    task: Mapping[str, Any], rng: random.Random, *, error_rate: float = 0.5, numbered: bool = False
) -> list[str]:
    """The actions of one demonstration, played to the episode's end (success or out of budget).

    The shortest solution, except that on a clean / heat / cool task it carries the object straight
    to the target, unprocessed, with probability ``error_rate``; after that put it recovers (takes
    the object back and processes it) until the budget runs out. See the module docstring.
    ``numbered``: each action is answered by its number in the listed actions instead of its text.
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"household: error_rate must be in [0, 1], got {error_rate}")
    room, budget = room_of(task)
    skip = room.task_type in PROCESSING and rng.random() < error_rate
    actions: list[str] = []
    while not room.satisfied() and len(actions) < budget:
        action = _next_action(room, skip_processing=skip)
        if action is None:
            break
        if action.startswith("put "):
            skip = False  # the habit is one put of the unprocessed object; then it recovers
        listed = str(room.admissible().index(action) + 1) if numbered else action
        room.apply(action)
        actions.append(listed)
    return actions


def build_task(*, numbered: bool = False, error_rate: float = 0.5):
    """The ``household`` entry of ``agent_r1.tasks.TASKS``: an ``AgentEnv`` task (no tools; the
    env reads the response as one action, its text or its number in the list, and rewards the
    outcome). ``numbered``: the demonstrator answers with numbers (the choice a small model can
    make: one token instead of copying ~25 characters); ``error_rate``: its habit's rate."""
    from agent_r1.tasks import TaskSpec

    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"household: error_rate must be in [0, 1], got {error_rate}")

    return TaskSpec(
        name="household",
        make_dataset=make_dataset,
        tools=list,
        tool_format=lambda: None,
        extract_answer=parse_action,
        reward=lambda answer, task: 0.0,  # the env rewards the outcome; no answer is scored apart
        demonstrate=functools.partial(demonstrate, error_rate=error_rate, numbered=numbered),
        max_turns=8 + DEFAULT_SLACK,
        make_env=make_env,
        required_fields=REQUIRED_FIELDS,
    )
