"""TextArena games (``textarena``, https://github.com/LeonGuertler/TextArena) as agent-r1 envs.

A TextArena env is synchronous and seat-based: ``reset(num_players, seed)``, then repeatedly
``get_observation() -> (player_id, messages)`` for whoever is to move and ``step(action_text) ->
(done, step_info)``; ``close() -> (rewards, game_info)`` gives every seat its reward once the game
is over. Its observations are ``(from_id, text, ObservationType)`` messages sent to a seat; its
observation wrappers (``LLMObservationWrapper`` etc.) turn them into one string per turn, and its
action wrappers (``ActionFormattingWrapper``: ``move`` -> ``[move]``) fix up what a player sends.

By default (``seats="row"``) one episode is ONE seat's game: the task row names the seat
(``{"id", "seed", "seat"}``, ``make_tasks``), the acting policy plays that seat, and every other
seat is played by the opponent (``opponent=``: ``random``, a scripted ``"module:function"``, an
OpenAI-compatible server, or ``self``: the acting policy itself through ``AgentEnv.policy``, not
trained in this trajectory). Each seat's steps therefore form that seat's own trajectory with that
seat's reward, and a GRPO group (n samples of one task row) compares like with like: same game, seed
and seat. Self-play this way lists both seats' rows, so every game is played twice, once per trained seat.

With ``seats="all"`` one episode is the WHOLE game: the rows name no seat, the policy plays every
seat, and each seat is a role (``Observation.role``, ``seat_roles``, default ``player_<i>``), so
``AgentEnvLoop`` returns one trajectory per seat that moved, each with that seat's reward (the
outcome is ``{role: reward}``); ``rollout_group`` links them (``info["episode"]``) and ``split_roles``
makes the (task, seat) groups. Use it for self-play of all seats (every game played once, both sides
of it trained, or one policy per role); use one seat per row to train against a fixed opponent (a
frozen seat: random, scripted or a served model), or when the trainer does not split roles.

The opponents' moves never reach the trained seat as actions: they arrive as the game reports them
(``[Player 1] [4]``, the new board), in the next prompt.

Offline: several games call ``nltk.download`` at import or reset (Hangman, Wordle, WordLadder,
Codenames, SpellingBee, ...). While this module drives a game, ``nltk.download`` is replaced by a
check that the resource is already installed (``nltk.data.find``), so a missing corpus is one
``MissingCorpusError`` naming it and how to install it, raised at once: no network call, no hang.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from agent_r1.envs.base import AgentEnv, EnvKwargsError, unknown_fields_message
from agent_r1.envs.context import (
    ContextPolicy,
    ContextRequest,
    PreviousTurn,
    encode_text,
    render_messages,
    resolve_context_policy,
)
from agent_r1.envs.ecosystem import require
from agent_r1.envs.registry import load_entry_point
from agent_r1.models.loading import require_chat_template
from agent_r1.types import Action, Message, Observation, SamplingParams, StepResult, StopReason, Task

__all__ = [
    "MissingCorpusError",
    "TextArenaEnv",
    "available_games",
    "make_tasks",
    "random_move",
]

EXTRA = "textarena"
GAME_ID = -1  # textarena.GAME_ID: the sender of the game's own messages
_BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")
_SENDER = re.compile(r"^\[[^\[\]\n]*\] ")  # "[GAME] ", "[Player 1] ": who sent a line, not a move
_NLTK_CATEGORIES = (
    "corpora",
    "taggers",
    "tokenizers",
    "chunkers",
    "grammars",
    "misc",
    "models",
    "sentiment",
    "stemmers",
)


class MissingCorpusError(LookupError):
    """A game needs an nltk resource that is not installed (and is never downloaded here)."""


def _textarena() -> Any:
    return require("textarena", EXTRA, "agent_r1.envs.ecosystem.textarena")


def available_games() -> list[str]:
    """Every env id TextArena registers (``textarena.make`` accepts these)."""
    _textarena()
    from textarena.envs.registration import ENV_REGISTRY

    return sorted(ENV_REGISTRY)


def make_tasks(game: str, seeds: Sequence[int], seats: Sequence[int] | None = (0,)) -> list[dict[str, Any]]:
    """One task row per (seed, seat): ``{"id": "TicTacToe-v0/s7/p1", "game", "seed", "seat"}``;
    ``seats=None``: one row per seed naming no seat, for ``seats: all`` (``{"id": "TicTacToe-v0/s7",
    "game", "seed"}``)."""
    if seats is None:
        return [{"id": f"{game}/s{seed}", "game": game, "seed": int(seed)} for seed in seeds]
    return [
        {"id": f"{game}/s{seed}/p{seat}", "game": game, "seed": int(seed), "seat": int(seat)}
        for seed in seeds
        for seat in seats
    ]


# ---------------------------------------------------------------------------------- nltk, offline


def _nltk_installed(resource: str) -> bool:
    import nltk

    for category in _NLTK_CATEGORIES:
        try:
            nltk.data.find(f"{category}/{resource}")
            return True
        except LookupError:
            continue
    return False


def _missing_corpus(game: str, resources: Sequence[str]) -> MissingCorpusError:
    names = " ".join(resources)
    return MissingCorpusError(
        f"TextArena game {game!r} needs the nltk resource(s) {', '.join(map(repr, resources))}, which "
        f"are not installed, and agent-r1 never downloads at run time. Install them once on a machine "
        f"with network: python -m nltk.downloader {names} (then copy the nltk_data folder here, or point "
        f"NLTK_DATA at it; searched: {_nltk_paths()})"
    )


def _nltk_paths() -> list[str]:
    import nltk

    return list(nltk.data.path)


@contextlib.contextmanager
def _offline_nltk(game: str) -> Iterator[None]:
    """While a game is made or played: ``nltk.download`` only checks, and nltk's own LookupError
    (a corpus read that finds nothing) becomes a ``MissingCorpusError`` naming the resource."""
    try:
        import nltk
    except ImportError:  # textarena imports nltk itself; without it there is nothing to guard
        yield
        return
    original = nltk.download

    def download(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
        ids = [info_or_id] if isinstance(info_or_id, str) else [str(i) for i in info_or_id or ()]
        missing = [i for i in ids if not _nltk_installed(i)]
        if missing:
            raise _missing_corpus(game, missing)
        return True

    nltk.download = download
    try:
        yield
    except LookupError as error:
        if isinstance(error, MissingCorpusError):
            raise
        found = re.search(r"Resource \x1b\[93m(\S+)\x1b\[0m|Resource (\S+) not found", str(error))
        if found is None:
            raise
        raise _missing_corpus(game, [found.group(1) or found.group(2)]) from error
    finally:
        nltk.download = original


@contextlib.contextmanager
def _time_limit(seconds: float | None, game: str) -> Iterator[None]:
    """Raise ``TimeoutError`` in a synchronous call that runs past ``seconds`` (SIGALRM; main thread
    only). An alarm already pending that is due sooner (e.g. pytest-timeout's) is left alone; one due
    later is re-armed afterwards with what is left of it."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    pending, _ = signal.getitimer(signal.ITIMER_REAL)
    if pending and pending <= seconds:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(
            f"TextArena game {game} did not return within {seconds} s (a game that loops forever, e.g. "
            "a multi-player state once every player is eliminated); env.kwargs.call_timeout_s sets the limit"
        )

    previous = signal.signal(signal.SIGALRM, expire)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if pending:
            signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - start), 1e-3))


# ------------------------------------------------------------------------------------- opponents


def random_move(observation_text: str, rng: random.Random) -> str:
    """A random move read off the observation: one of the bracketed moves in the last line that
    lists two or more (TextArena's boards end with ``Available Moves: '[0]', '[4]'``, its other games
    with ``Valid moves: [a], [b]``), else any bracketed token in the text, else ``[0]``; the sender
    tags that open the lines (``[GAME]``, ``[Player 1]``) are not moves."""
    lines = [_SENDER.sub("", line) for line in observation_text.splitlines()]
    for line in reversed(lines):
        moves = _BRACKETED.findall(line)
        if len(moves) >= 2:
            return rng.choice(moves)
    moves = _BRACKETED.findall("\n".join(lines))
    return rng.choice(moves) if moves else "[0]"


def _scripted(entry_point: str) -> Callable[[str], str]:
    target = load_entry_point(entry_point)
    if isinstance(target, type):  # a textarena Agent class (or any class whose instances are callable)
        target = target()
    if not callable(target):
        raise TypeError(f"TextArenaEnv: opponent {entry_point!r} is a {type(target).__name__}, not callable")
    return target


# ------------------------------------------------------------------------------------------ the env


class TextArenaEnv(AgentEnv):
    """One seat of one TextArena game per episode, or every seat (``seats="all"``; see the module
    docstring).

    Task row: ``{"id", "seed": int (optional; None = unseeded), "seat": int (default 0; refused with
    ``seats="all"``), "game": str (optional, over the ``game`` kwarg), "num_players": int (optional,
    over the ``num_players`` kwarg)}``; ``make_tasks`` writes them. A row with any other field is refused.

    Args (``env.kwargs``):
        tokenizer: the policy's tokenizer (injected by the trainer); it must have a chat template.
        seats: ``"row"`` (default): the policy plays the row's seat, the opponent every other seat.
            ``"all"``: the policy plays every seat, each seat a role (``Observation.role``), so one
            game gives one trajectory per seat that moved; no opponent (one given is refused).
        seat_roles: with ``seats="all"``, the role of each seat, seat 0 first (default
            ``player_0``, ``player_1``, ...); at least as many as the game has seats.
        game: the TextArena env id, e.g. ``"TicTacToe-v0"``, ``"GuessTheNumber-v0"``; its registered
            wrappers apply (``-raw`` ids have none, ``-train`` ids their training wrappers).
        num_players: the game's seat count; None: 1 for a game whose state is TextArena's
            ``SinglePlayerState``, else 2 (set it for games of 3+ players). A count the game refuses
            is a ValueError quoting the game's reason.
        opponent: who plays the other seats (None, the default: ``"random"``, and no opponent in a
            single-player game: one given with a single-player ``game`` is refused, and a row that
            names a single-player game of its own has none): ``"random"`` (a random bracketed move read off the
            seat's observation; for TextArena's boards a random legal move), ``"self"`` (the acting
            policy, with the flow's sampling params, not trained in this trajectory), an entry point
            ``"module:function"`` (``function(observation_text) -> action_text``; a class is
            instantiated first, so a ``textarena.Agent`` works), or ``{"openai": {"base_url",
            "model", "temperature"=0.0, "max_tokens"=64, "api_key"}}`` (a frozen model behind any
            OpenAI-compatible completions server, sent token ids in the policy's tokenizer).
        observation: ``"chat"`` (default): each turn of the seat is one user message holding what the
            game sent it since its last move (``[GAME] ...``, ``[Player 1] ...`` lines; its own echoed
            move left out: it is the assistant turn), built by the context policy — ``append`` keeps
            every prompt an exact token extension of the previous prompt + response.
            ``"text"``: the game's observation wrapper's string (the whole history for
            ``LLMObservationWrapper``, prompt + current board for ``-train`` ids) as the single user
            message of a fresh prompt each turn: re-rendered, never an extension.
        context / context_kwargs: the context policy for ``observation="chat"``
            (``agent_r1.envs.context``).
        system_prompt: an optional system message opening every prompt.
        max_turns: the seat's moves before the episode is truncated (outcome 0.0), beyond the game's
            own limits; with ``seats="all"`` each seat's: the episode is truncated (every role's
            outcome 0.0) when the seat to move has made ``max_turns`` moves.
        game_kwargs: keyword arguments for ``textarena.make`` over the registered ones (e.g.
            ``{"max_number": 10}`` for GuessTheNumber).
        success_threshold: a single-player game counts as solved (``win``) when its reward is at least
            this (GuessTheNumber gives 1 on a hit and a closeness score below 1 otherwise).
        call_timeout_s: the longest one TextArena call may run before ``TimeoutError`` (TextArena's
            multi-player states loop forever once every player is eliminated); enforced with
            SIGALRM, so on the main thread only; None: no limit.

    Rewards: the game's reward for the seat (``close()``), once, as ``outcome_reward``: +1 / -1 / 0
    for win / loss / draw in TextArena's two-player games (an invalid move twice in a row loses).
    Metrics (``StepResult.metrics`` -> ``env/<name>``): ``invalid_actions`` every step; ``win``,
    ``draw``, ``loss`` on the last. ``info["episode"] = {"game", "seat", "num_players", "opponent"}``
    on every step (the trajectory viewer shows it); ``info["success"]`` (= win) on the last.
    With ``seats="all"`` the outcome is ``{role: that seat's reward}``, every step's ``invalid_actions``
    and ``info["episode"]["seat"]`` are the moving seat's, and the last step reports ``<role>_win``
    for every role and ``draw`` instead of ``win`` / ``draw`` / ``loss``, and ``info["success"]`` as
    ``{role: won}`` (each seat's trajectory gets its own: ``AgentEnvLoop``).
    When the other seats end the game before this seat's first move (two invalid moves of theirs),
    ``reset`` returns the ended ``StepResult`` (``AgentEnv.reset``): the seat is never prompted, its
    trajectory has no step to train, and the game's outcome stays on the trajectory
    (``info["ended_at_reset"]``: ``before_first_move`` True, the rewards and the game's ``reason``).
    """

    task_fields = ("id", "game", "seed", "seat", "num_players")

    @classmethod
    def check_kwargs(cls, kwargs: Mapping[str, Any]) -> None:
        """The seats settings consistent, the game registered and a scripted opponent importable,
        before the model loads."""
        refused = _seats_refused(kwargs.get("seats", "row"), kwargs.get("seat_roles"), kwargs.get("opponent"))
        if refused:
            raise EnvKwargsError(*refused)
        opponent = kwargs.get("opponent")
        if isinstance(opponent, str) and ":" in opponent:
            try:
                load_entry_point(opponent)
            except ValueError as error:
                raise EnvKwargsError("opponent", str(error)) from None
        game = kwargs.get("game")
        if isinstance(game, str):
            try:
                _check_game(game)
            except ImportError:
                return  # the constructor says how to install textarena
            except ValueError as error:
                raise EnvKwargsError("game", str(error)) from None

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        game: str = "TicTacToe-v0",
        num_players: int | None = None,
        seats: str = "row",
        seat_roles: Sequence[str] | None = None,
        opponent: str | Mapping[str, Any] | None = None,
        observation: str = "chat",
        context: str | ContextPolicy = "append",
        context_kwargs: dict[str, Any] | None = None,
        system_prompt: str | None = None,
        max_turns: int = 32,
        game_kwargs: dict[str, Any] | None = None,
        success_threshold: float = 1.0,
        call_timeout_s: float | None = 60.0,
    ) -> None:
        _textarena()
        require_chat_template(tokenizer)
        if observation not in ("chat", "text"):
            raise ValueError(f"TextArenaEnv: observation must be 'chat' or 'text', got {observation!r}")
        if max_turns < 1:
            raise ValueError(f"TextArenaEnv: max_turns must be >= 1, got {max_turns}")
        if num_players is not None and num_players < 1:
            raise ValueError(f"TextArenaEnv: num_players must be >= 1, got {num_players}")
        refused = _seats_refused(seats, seat_roles, opponent)
        if refused:
            raise EnvKwargsError(*refused)
        self.tokenizer = tokenizer
        self.all_seats = seats == "all"
        self.seat_roles = None if seat_roles is None else list(seat_roles)
        self.default_game = game
        self.num_players_wanted = num_players
        self.opponent_spec = opponent
        self.opponent_given = opponent is not None
        self.opponent_name, self._opponent_engine, self._scripted_opponent = _opponent(
            "random" if opponent is None else opponent
        )
        self.observation_mode = observation
        self.context = resolve_context_policy(context, context_kwargs, "TextArenaEnv")
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self.game_kwargs = dict(game_kwargs or {})
        self.success_threshold = success_threshold
        self.call_timeout_s = call_timeout_s
        self._game: Any = None

    # -- episode

    async def reset(self, task: Task) -> Observation | StepResult:
        self.task_name = str(task.get("id", "(no id)"))
        refused = unknown_fields_message(task, self.task_fields, "textarena")
        if refused:
            raise ValueError(f"task {self.task_name}: {refused}")
        self.game_id = str(task.get("game", self.default_game))
        wanted = task.get("num_players", self.num_players_wanted)
        if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1):
            raise ValueError(f"task {self.task_name}: 'num_players' must be an integer >= 1, got {wanted!r}")
        seed = task.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"task {self.task_name}: 'seed' must be an integer, got {seed!r}")
        if self.all_seats and "seat" in task:
            raise ValueError(
                f"task {self.task_name}: names seat {task['seat']!r}, but with seats: all the policy plays "
                "every seat of the game: remove 'seat' from the row (make_tasks(..., seats=None)), or use "
                "seats: row for one seat per row"
            )
        seat = None if self.all_seats else task.get("seat", 0)
        if not self.all_seats and (isinstance(seat, bool) or not isinstance(seat, int)):
            raise ValueError(f"task {self.task_name}: 'seat' must be an integer, got {seat!r}")
        self.seed, self.seat = seed, seat
        # TextArena seeds the global `random` (State.__init__); each game keeps its own stream, so
        # concurrent episodes do not disturb each other or the caller.
        self._rng_state = random.Random(seed).getstate()
        self._opponent_rng = random.Random(f"{seed}/{seat}/opponent")
        self.num_players = self._start_game(seed, wanted)
        # The opponent plays the other seats of env.kwargs.game; a row naming another game that has
        # no other seat (a mixed dataset) simply has none (its episode says opponent: null).
        if self.num_players == 1 and self.opponent_given and self.game_id == self.default_game:
            raise ValueError(
                f"task {self.task_name}: {self.game_id} is a single-player game, so there is no seat for "
                f"opponent {self.opponent_name!r}: remove env.kwargs.opponent"
            )
        # The seats the policy plays, each with its role (None: the episode's one role).
        self.roles: dict[int, str | None] = self._policy_seats(seat)
        self.turns = dict.fromkeys(self.roles, 0)  # each policy seat's moves
        self._histories: dict[int, list[str]] = {pid: [] for pid in range(self.num_players)}
        self._opponent_chats: dict[int, list[Message]] = {}
        self._chats: dict[int, tuple[tuple[Message, ...], tuple[int, ...]]] = {}  # seat: (messages, ids)
        self._responses: dict[int, Action] = {}  # each policy seat's last action
        self._wrapper_text: str | None = None
        self.episode = {
            "game": self.game_id,
            "seat": seat,
            "num_players": self.num_players,
            "opponent": self.opponent_name if self.num_players > 1 and not self.all_seats else None,
        }
        to_move = await self._play_until_policy_seat()
        if to_move is None:  # the others ended the game before this seat moved (e.g. invalid moves)
            info = {"episode": self.episode, "turn": 0, "before_first_move": True}
            return self._end(info, invalid=False, mover=seat)
        return await self._prompt(*to_move)

    async def step(self, action: Action) -> StepResult:
        mover = self._to_move
        info: dict[str, Any] = {"episode": {**self.episode, "seat": mover}, "turn": self.turns[mover]}
        text = self._action_text(action)
        self.turns[mover] += 1
        self._responses[mover] = action
        before = self._error_state(mover)
        done = self._call(lambda: self._game.step(action=text))[0]
        invalid = self._invalid(mover, before)
        info["invalid"] = invalid
        to_move = None if done else await self._play_until_policy_seat()
        if to_move is None:
            return self._end(info, invalid, mover)
        if self.turns[to_move[0]] >= self.max_turns:
            outcome, standing, metrics = self._standings(None)
            return StepResult(
                None,
                truncated=True,
                outcome_reward=outcome,
                info={**info, **standing, "truncated": f"max_turns={self.max_turns}"},
                metrics={"invalid_actions": float(invalid), **metrics},
            )
        observation = await self._prompt(*to_move)
        return StepResult(observation, info=info, metrics={"invalid_actions": float(invalid)})

    async def close(self) -> None:
        if self._opponent_engine is not None:
            await self._opponent_engine.aclose()

    # -- the game

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run one TextArena call on this game's own `random` stream, with nltk kept offline."""
        outside = random.getstate()
        random.setstate(self._rng_state)
        try:
            with _offline_nltk(self.game_id), _time_limit(self.call_timeout_s, self.game_id):
                return fn()
        finally:
            self._rng_state = random.getstate()
            random.setstate(outside)

    def _make(self) -> Any:
        ta = _textarena()
        _check_game(self.game_id)
        try:
            return self._call(lambda: ta.make(self.game_id, **self.game_kwargs))
        except TypeError as error:
            raise ValueError(
                f"TextArenaEnv: game_kwargs {self.game_kwargs} for {self.game_id}: {error}"
            ) from error
        except (ImportError, SyntaxError) as error:  # e.g. a game written for a newer Python
            if isinstance(error, MissingCorpusError):
                raise
            raise ValueError(
                f"TextArena game {self.game_id} cannot be imported here: {type(error).__name__}: {error}"
            ) from error

    def _start_game(self, seed: int | None, wanted: int | None) -> int:
        """Make and reset the game; the player count is ``wanted`` (the row's or the env's
        ``num_players``), else probed: 1 for a game whose state is TextArena's ``SinglePlayerState``
        (its multi-player states accept one player too, and some then loop forever), else 2."""
        candidates = [wanted] if wanted else [1, 2]
        refusals = []
        for n in candidates:
            game = self._make()
            try:
                self._call(lambda game=game, n=n: game.reset(num_players=n, seed=seed))
            except (AssertionError, ValueError) as error:
                refusals.append(f"{n}: {error}")
                continue
            single = isinstance(getattr(_innermost(game), "state", None), _textarena().SinglePlayerState)
            if wanted is None and n == 1 and not single:
                refusals.append("1: not a single-player game")
                continue
            self._game = game
            self._base = _innermost(game)
            self._wrappers = _observation_wrappers(game)
            return n
        hint = "" if wanted else "; set num_players to the count it needs"
        raise ValueError(f"TextArena game {self.game_id} refuses num_players {' / '.join(refusals)}{hint}")

    def episode_roles(self) -> list[str] | None:
        """With ``seats="all"``, after ``reset``: the role of every seat (None: one seat per row)."""
        if not self.all_seats or not hasattr(self, "roles"):
            return None
        return list(self.roles.values())

    def _policy_seats(self, seat: int | None) -> dict[int, str | None]:
        """The seats the policy plays and their roles: the row's seat (no role: the episode has one),
        or with ``seats="all"`` every seat, each its ``seat_roles`` entry or ``player_<seat>``."""
        if not self.all_seats:
            assert seat is not None
            if not 0 <= seat < self.num_players:
                raise ValueError(
                    f"task {self.task_name}: seat {seat} does not exist in {self.game_id} with "
                    f"{self.num_players} player(s); seats: 0..{self.num_players - 1}"
                )
            return {seat: None}
        roles = self.seat_roles or [f"player_{pid}" for pid in range(self.num_players)]
        if len(roles) < self.num_players:
            raise ValueError(
                f"task {self.task_name}: {self.game_id} has {self.num_players} seats but env.kwargs.seat_roles "
                f"names {len(roles)} ({roles}): name a role for every seat"
            )
        return dict(enumerate(roles[: self.num_players]))

    def _observe(self) -> tuple[int, str]:
        """Whose turn it is and what the game told that seat since its last turn (chat lines); the
        seat's own echoed move is left out (it is the seat's assistant turn). Feeds the game's own
        observation wrappers too, for ``observation="text"``."""
        pid, raw = self._call(self._base.get_observation)
        if self.observation_mode == "text" and pid in self.roles:
            text: Any = raw
            for wrapper in self._wrappers:
                text = self._call(lambda w=wrapper, o=text: w.observation(pid, o))
            self._wrapper_text = text if self._wrappers else None
        roles = getattr(self._base.state, "role_mapping", {})
        lines = []
        for sender, message, kind in raw:
            if sender == pid and getattr(kind, "name", "") == "PLAYER_ACTION":
                continue
            name = "GAME" if sender == GAME_ID else roles.get(sender, f"Player {sender}")
            lines.append(f"[{name}] {message}")
        new_text = "\n".join(lines)
        self._histories[pid].append(new_text)
        return pid, new_text

    async def _play_until_policy_seat(self) -> tuple[int, str] | None:
        """Let the opponents move until a seat the policy plays is to move: that seat and its new
        text, or None once the game is over."""
        while not self._done():
            pid, new_text = self._observe()
            if pid in self.roles:
                return pid, new_text
            move = await self._opponent_move(pid, new_text)
            if self._call(lambda move=move: self._game.step(action=move))[0]:
                break
        return None

    def _done(self) -> bool:
        return bool(getattr(self._base.state, "done", False))

    def _error_state(self, seat: int) -> tuple[int, bool]:
        state = self._base.state
        invalid_flag = bool(state.game_info.get(seat, {}).get("invalid_move", False))
        return int(getattr(state, "error_count", 0)), invalid_flag

    def _invalid(self, seat: int, before: tuple[int, bool]) -> bool:
        """TextArena's states count a seat's invalid moves in ``error_count`` (reset by a valid move)
        and flag the one that ends the game in ``game_info[seat]["invalid_move"]``."""
        count, flag = self._error_state(seat)
        return count > before[0] or (flag and not before[1])

    def _end(self, info: dict[str, Any], invalid: bool, mover: int | None) -> StepResult:
        """The game is over: every seat's reward, who won, and the game's reason (as ``mover``'s
        ``game_info`` says it; TextArena's two-player states give every seat the same)."""
        rewards, game_info = self._call(self._game.close)
        rewards = dict(rewards or {})
        bad = {pid: r for pid, r in rewards.items() if isinstance(r, bool) or not isinstance(r, int | float)}
        if bad:
            raise RuntimeError(
                f"TextArena game {self.game_id} returned non-numeric rewards {bad} (a bug in the game)"
            )
        outcome, standing, metrics = self._standings(rewards)
        reason = (game_info or {}).get(mover, {}).get("reason")
        return StepResult(
            None,
            terminated=True,
            outcome_reward=outcome,
            info={
                **info,
                **standing,
                "rewards": {str(pid): float(r) for pid, r in rewards.items()},
                "reason": None if reason is None else str(reason),
            },
            metrics={"invalid_actions": float(invalid), **metrics},
        )

    def _standings(
        self, rewards: Mapping[int, float] | None
    ) -> tuple[float | dict[str, float], dict[str, Any], dict[str, float]]:
        """(outcome_reward, info, metrics) of the end, from every seat's reward; None: cut short by
        ``max_turns``, every outcome 0.0 and nobody won, drew or lost. One seat per row: its reward,
        ``info["success"]`` and ``win`` / ``draw`` / ``loss``. All seats: ``{role: reward}``,
        ``{role: won}`` as ``info["success"]``, ``<role>_win`` and ``draw``."""
        if rewards is None:
            won, draw = dict.fromkeys(self.roles, False), False
        else:
            won, draw = {pid: self._won(rewards, pid) for pid in self.roles}, self._drawn(rewards)
        reward = {pid: float((rewards or {}).get(pid, 0.0)) for pid in self.roles}
        if self.all_seats:
            metrics = {f"{role}_win": float(won[pid]) for pid, role in self.roles.items()}
            outcome = {role: reward[pid] for pid, role in self.roles.items()}
            success = {role: won[pid] for pid, role in self.roles.items()}  # each seat's own
            return outcome, {"success": success}, {**metrics, "draw": float(draw)}
        (seat,) = self.roles
        lost = rewards is not None and not won[seat] and not draw
        metrics = {"win": float(won[seat]), "draw": float(draw), "loss": float(lost)}
        return reward[seat], {"success": won[seat]}, metrics

    def _won(self, rewards: Mapping[int, float], seat: int) -> bool:
        """``seat``'s reward above every other seat's (single-player: at least ``success_threshold``)."""
        mine = float(rewards.get(seat, 0.0))
        if self.num_players == 1:
            return mine >= self.success_threshold
        others = [float(r) for pid, r in rewards.items() if pid != seat]
        return bool(others) and mine > max(others)

    def _drawn(self, rewards: Mapping[int, float]) -> bool:
        """Every seat of a multi-player game got the same reward."""
        return self.num_players > 1 and len(rewards) > 1 and len({float(r) for r in rewards.values()}) == 1

    # -- prompts

    def _action_text(self, action: Action) -> str:
        text = action.text
        for token in (self.tokenizer.eos_token, "<|im_end|>", "<|endoftext|>"):
            if token:
                text = text.removesuffix(token)
        return text

    async def _prompt(self, seat: int, new_text: str) -> Observation:
        """``seat``'s next prompt, tagged with its role: its own conversation (the previous prompt +
        its last response + ``new_text``) or, with ``observation="text"``, the game's wrapper string."""
        self._to_move = seat
        role = self.roles[seat]
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if self.observation_mode == "text":
            text = self._wrapper_text if self._wrapper_text is not None else "\n".join(self._histories[seat])
            return Observation(messages=(*head, {"role": "user", "content": text}), role=role)
        response = self._responses.get(seat)
        if response is None:
            messages: tuple[Message, ...] = (*head, {"role": "user", "content": new_text})
            request = ContextRequest(messages, policy=self.policy)
        else:
            carried, previous = self._chats[seat]
            turn = PreviousTurn(previous, response.token_ids, num_messages=len(carried))
            messages = (
                *carried,
                {"role": "assistant", "content": self._action_text(response)},
                {"role": "user", "content": new_text},
            )
            request = ContextRequest(messages, previous=turn, policy=self.policy)
        prompt = await self.context.build(self.tokenizer, request)
        self._chats[seat] = (prompt.messages, prompt.token_ids)
        return Observation(token_ids=prompt.token_ids, role=role)

    async def _opponent_move(self, pid: int, new_text: str) -> str:
        if self.opponent_name == "random":
            return random_move("\n".join(self._histories[pid][-1:]), self._opponent_rng)
        if self._scripted_opponent is not None:
            return str(self._scripted_opponent("\n".join(self._histories[pid])))
        # A model: "self" (the lent policy) or a frozen one behind a server; its own chat, re-rendered.
        chat = self._opponent_chats.setdefault(
            pid, [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        chat.append({"role": "user", "content": new_text})
        prompt_ids = encode_text(self.tokenizer, render_messages(self.tokenizer, chat))
        if self.opponent_name == "self":
            if self.policy is None:
                raise RuntimeError(
                    "TextArenaEnv: opponent 'self' plays the other seats with the acting policy, but no "
                    "policy was lent (AgentEnvLoop lends it; outside a flow use check_env(..., engine=))"
                )
            completion = await self.policy.generate(prompt_ids)
        else:
            engine, params = self._opponent_engine, self._opponent_params
            completion = await engine.generate(prompt_ids, params)
        if completion.finish_reason is StopReason.ABORT:
            raise RuntimeError(f"TextArenaEnv: the opponent's request failed: {completion.error}")
        move = self.tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
        chat.append({"role": "assistant", "content": move})
        return move

    @property
    def _opponent_params(self) -> SamplingParams:
        spec = dict(self.opponent_spec["openai"])  # type: ignore[index]
        return SamplingParams(
            temperature=float(spec.get("temperature", 0.0)), max_tokens=int(spec.get("max_tokens", 64))
        )


def _check_game(game_id: str) -> None:
    """A ValueError naming the variants (or the games) when TextArena has no game ``game_id``; an
    ImportError without textarena."""
    from textarena.envs.registration import ENV_REGISTRY

    if game_id not in ENV_REGISTRY:
        variants = [g for g in sorted(ENV_REGISTRY) if g.split("-")[0] == game_id.split("-")[0]]
        games = sorted({g.split("-")[0] for g in ENV_REGISTRY})
        raise ValueError(
            f"unknown TextArena game {game_id!r}; "
            + (f"its variants: {variants}" if variants else f"games: {games}")
            + " (every id: agent_r1.envs.ecosystem.textarena.available_games())"
        )


def _seats_refused(seats: Any, seat_roles: Any, opponent: Any) -> tuple[str, str] | None:
    """(key, why) when the ``seats`` settings do not fit together, else None (``check_kwargs`` and the
    constructor both ask)."""
    if seats not in ("row", "all"):
        return "seats", (
            f"must be 'row' (the policy plays the row's seat, the opponent the others) or 'all' (the "
            f"policy plays every seat, each a role), got {seats!r}"
        )
    if seats == "row":
        if seat_roles is not None:
            return "seat_roles", "names the roles of seats: all; with seats: row the episode has one role"
        return None
    if opponent is not None:
        return "opponent", (
            f"{json.dumps(opponent, default=str)} is given, but with seats: all the policy plays every "
            "seat, so there is none: remove it, or use seats: row (a frozen seat is played by the opponent)"
        )
    if seat_roles is None:
        return None
    if (
        isinstance(seat_roles, str)
        or not isinstance(seat_roles, Sequence)
        or not seat_roles
        or not all(isinstance(r, str) and r for r in seat_roles)
    ):
        return "seat_roles", f"must be a list of role names, seat 0's first, got {seat_roles!r}"
    if len(set(seat_roles)) != len(seat_roles):
        return "seat_roles", f"names a role twice ({list(seat_roles)}): each seat is a role of its own"
    return None


def _opponent(spec: str | Mapping[str, Any]) -> tuple[str, Any, Callable[[str], str] | None]:
    """(name shown in info, engine for a model opponent, scripted callable)."""
    if isinstance(spec, str):
        if spec in ("random", "self"):
            return spec, None, None
        if ":" in spec:
            return spec, None, _scripted(spec)
    elif isinstance(spec, Mapping) and set(spec) == {"openai"} and isinstance(spec["openai"], Mapping):
        settings = dict(spec["openai"])
        missing = [k for k in ("base_url", "model") if k not in settings]
        unknown = sorted(set(settings) - {"base_url", "model", "temperature", "max_tokens", "api_key"})
        if missing or unknown:
            raise ValueError(
                f"TextArenaEnv: opponent.openai needs base_url and model (missing {missing}); "
                f"it also takes temperature, max_tokens, api_key (unknown: {unknown})"
            )
        from agent_r1.rollout.openai_client import OpenAIEngine

        engine = OpenAIEngine(settings["base_url"], settings["model"], api_key=settings.get("api_key"))
        return f"openai:{settings['model']}", engine, None
    raise ValueError(
        f"TextArenaEnv: opponent must be 'random', 'self', an entry point "
        f"'module:function', or {{'openai': {{'base_url': ..., 'model': ...}}}}; got {json.dumps(spec, default=str)}"
    )


def _innermost(env: Any) -> Any:
    ta = _textarena()
    while isinstance(env, ta.Wrapper):
        env = env.env
    return env


def _observation_wrappers(env: Any) -> list[Any]:
    """The game's observation wrappers, innermost first (they only shape ``get_observation``)."""
    ta = _textarena()
    found = []
    while isinstance(env, ta.Wrapper):
        if isinstance(env, ta.ObservationWrapper):
            found.append(env)
        env = env.env
    return found[::-1]
