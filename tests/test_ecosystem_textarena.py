"""TextArena adapter (agent_r1/envs/ecosystem/textarena.py) against the real ``textarena`` games:
scripted episodes of a two-player game (each seat, random / scripted / self-play opponents) and a
single-player game, exact token append, the re-rendered text mode, metrics, the offline nltk guard,
bad input, and one training run per kind of game through the real Trainer."""

from __future__ import annotations

import asyncio
import functools
import random
import sys
import time

import pytest
import torch

from agent_r1.envs import check_env, make_env
from agent_r1.envs.base import LentPolicy
from agent_r1.envs.ecosystem import MissingPackageError, require
from agent_r1.envs.ecosystem import textarena as ta_env
from agent_r1.envs.ecosystem import textarena_players as players
from agent_r1.envs.ecosystem.textarena import MissingCorpusError, TextArenaEnv, make_tasks, random_move
from agent_r1.models.tiny import build_tiny_tokenizer
from agent_r1.report.run import trajectory_view
from agent_r1.train.builders import env_factory
from agent_r1.train.config import config_from_dict
from agent_r1.train.sft import replay_demonstrations
from agent_r1.types import Action, Completion, StopReason, Trajectory, read_jsonl

TOKENIZER = build_tiny_tokenizer()
EOS = TOKENIZER.eos_token


def act(text: str) -> Action:
    return Action(text + EOS, [*TOKENIZER.encode(text, add_special_tokens=False), TOKENIZER.eos_token_id])


def play(task, moves, policy: LentPolicy | None = None, **kwargs):
    """(first observation, every StepResult, the env) of an episode driven by ``moves``."""

    async def run():
        env = TextArenaEnv(TOKENIZER, **kwargs)
        if policy is not None:
            env.lend_policy(policy)
        first = await env.reset(task)
        results = []
        for move in moves:
            result = await env.step(act(move))
            results.append(result)
            if result.terminated or result.truncated:
                break
        await env.close()
        return first, results, env

    return asyncio.run(run())


def last_user(env: TextArenaEnv) -> str:
    return env._chats[env.seat][0][-1]["content"]


def text(ids) -> str:
    return TOKENIZER.decode(list(ids), skip_special_tokens=False)


# ------------------------------------------------------------------------------------- two players


def test_seat_0_against_random_sees_the_opponents_moves_and_wins_with_reward_one():
    first, results, env = play({"id": "t", "seed": 0, "seat": 0}, ["[4]", "[0]", "[8]"], game="TicTacToe-v0")
    prompt = text(first.token_ids)
    assert "[GAME] You are Player 0 in Tic Tac Toe." in prompt and "you will be 'O'" in prompt
    assert prompt.endswith(
        "Available Moves: '[0]', '[1]', '[2]', '[3]', '[4]', '[5]', '[6]', '[7]', '[8]'<|im_end|>\n<|im_start|>assistant\n"
    )
    # The random opponent's move arrives as the game reports it, after the seat's own move.
    second = text(results[0].observation.token_ids)
    assert "[Player 1] [2]\n[GAME] Player 1 placed their symbol (X) in cell 2." in second
    assert "[Player 0] [4]" not in second  # the seat's own echo is its assistant turn
    assert [r.terminated for r in results] == [False, False, True]
    last = results[-1]
    assert last.outcome_reward == 1.0 and last.observation is None
    assert last.metrics == {"invalid_actions": 0.0, "win": 1.0, "draw": 0.0, "loss": 0.0}
    assert last.info["success"] is True and last.info["reason"] == "Player 0 has won!"
    assert last.info["rewards"] == {"0": 1.0, "1": -1.0}
    assert last.info["episode"] == {"game": "TicTacToe-v0", "seat": 0, "num_players": 2, "opponent": "random"}
    assert all(r.outcome_reward is None and r.reward == 0.0 for r in results[:-1])


def test_seat_1_moves_second_counts_an_invalid_move_and_its_reward_is_its_own():
    first, results, env = play(
        {"id": "t", "seed": 0, "seat": 1}, ["[4]", "[0]", "[8]", "[2]", "[6]"], game="TicTacToe-v0"
    )
    assert "[Player 0] [5]\n[GAME] Player 0 placed their symbol (O) in cell 5." in text(first.token_ids)
    assert [r.metrics["invalid_actions"] for r in results] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert "Reason: cell 8 is already occupied." in text(results[2].observation.token_ids)
    assert results[-1].outcome_reward == 1.0 and results[-1].info["reason"] == "Player 1 has won!"


def test_two_invalid_moves_in_a_row_lose_the_game():
    _, results, _ = play({"id": "t", "seed": 0, "seat": 0}, ["no move", "[99]"], game="TicTacToe-v0")
    assert [r.metrics["invalid_actions"] for r in results] == [1.0, 1.0]
    assert results[-1].terminated and results[-1].outcome_reward == -1.0
    assert results[-1].metrics["loss"] == 1.0 and results[-1].info["success"] is False
    # The viewer says why, in the game's words (it read "failed" before).
    from doubles import ScriptedEngine

    from agent_r1.flows import AgentEnvLoop
    from agent_r1.types import SamplingParams

    flow = AgentEnvLoop(lambda: TextArenaEnv(TOKENIZER), TOKENIZER, SamplingParams(max_tokens=8))
    lost = asyncio.run(flow.run(ScriptedEngine(TOKENIZER, ["no move", "[99]"]), {"id": "t", "seed": 0}))
    reason = lost.steps[-1].info["reason"]
    assert reason and trajectory_view(lost, 0, 0)["reason"] == f"failed: {reason}"


def test_a_scripted_entry_point_opponent_plays_its_moves():
    opponent = "agent_r1.envs.ecosystem.textarena_players:tictactoe"
    _, results, env = play(
        {"id": "t", "seed": 5, "seat": 0},
        ["[0]", "[1]", "[3]", "[5]"],
        game="TicTacToe-v0",
        opponent=opponent,
    )
    # The scripted player takes the centre, then blocks: O at 0 and 1 -> X at 2.
    assert "[Player 1] [4]" in text(results[0].observation.token_ids)
    assert "[Player 1] [2]" in text(results[1].observation.token_ids)
    assert env.episode["opponent"] == opponent


def test_self_play_asks_the_lent_policy_for_the_other_seat_and_trains_nothing_of_it():
    asked = []

    async def generate(prompt_ids):
        asked.append(text(prompt_ids))
        move = ["[8]", "[7]", "[6]"][len(asked) - 1]
        ids = [*TOKENIZER.encode(move, add_special_tokens=False), TOKENIZER.eos_token_id]
        return Completion(ids, [0.0] * len(ids), StopReason.STOP)

    _, results, env = play(
        {"id": "t", "seed": 1, "seat": 0},
        ["[0]", "[1]", "[2]"],
        policy=LentPolicy(generate),
        game="TicTacToe-v0",
        opponent="self",
    )
    assert len(asked) == 2 and results[-1].outcome_reward == 1.0
    assert "You are Player 1 in Tic Tac Toe." in asked[0] and "[Player 0] [0]" in asked[0]
    assert asked[1].startswith(asked[0])  # the opponent seat keeps its own conversation
    assert all(r.policy_steps == () for r in results)
    assert env.episode["opponent"] == "self"


def test_self_play_without_a_lent_policy_says_what_is_missing():
    with pytest.raises(RuntimeError, match="opponent 'self'.*no policy was lent"):
        play({"id": "t", "seed": 1, "seat": 1}, [], game="TicTacToe-v0", opponent="self")


def test_a_model_opponent_is_asked_through_its_engine(monkeypatch):
    sent = []

    class FakeEngine:
        def __init__(self, base_url, model, api_key=None):
            self.closed = False

        async def generate(self, prompt_ids, params):
            sent.append(params)
            ids = [*TOKENIZER.encode("[8]", add_special_tokens=False), TOKENIZER.eos_token_id]
            return Completion(ids, [0.0] * len(ids), StopReason.STOP)

        async def aclose(self):
            self.closed = True

    monkeypatch.setattr("agent_r1.rollout.openai_client.OpenAIEngine", FakeEngine)
    opponent = {"openai": {"base_url": "http://localhost:1/v1", "model": "frozen", "max_tokens": 8}}
    _, results, env = play({"id": "t", "seed": 1, "seat": 0}, ["[0]"], game="TicTacToe-v0", opponent=opponent)
    assert "[Player 1] [8]" in text(results[0].observation.token_ids)
    assert sent[0].max_tokens == 8 and sent[0].temperature == 0.0
    assert env._opponent_engine.closed and env.episode["opponent"] == "openai:frozen"


def test_append_prompts_are_exact_extensions_of_prompt_plus_response():
    first, results, _ = play(
        {"id": "t", "seed": 0, "seat": 1}, ["[4]", "[0]", "[8]", "[2]"], game="TicTacToe-v0"
    )
    prompts = [first.token_ids, *(r.observation.token_ids for r in results if r.observation)]
    for move, before, after in zip(["[4]", "[0]", "[8]"], prompts, prompts[1:], strict=False):
        assert after[: len(before) + len(act(move).token_ids)] == (*before, *act(move).token_ids)


def test_text_mode_shows_the_games_own_wrapper_string_rerendered_each_turn():
    first, results, _ = play(
        {"id": "t", "seed": 3, "seat": 0}, ["[4]", "[0]"], game="TicTacToe-v0-train", observation="text"
    )
    (message,) = results[1].observation.messages
    # GameMessagesAndCurrentBoardObservationWrapper: the prompt, the moves so far, the current board.
    assert message["content"].startswith("You are Player 0 in Tic Tac Toe.")
    assert (
        "Player 0 placed their symbol (O) in cell 4.\nPlayer 1 placed their symbol (X) in cell 1."
        in message["content"]
    )
    assert message["content"].endswith("Available Moves: '[3]', '[5]', '[6]', '[7]', '[8]'")
    assert len(first.messages) == 1


# ---------------------------------------------------------------------------- every seat of one game

# A replayed game: the moves in the order the seats make them (seat 0 first), and every seat's reward.
GAMES = {
    "TicTacToe-v0": (["[4]", "[0]", "[2]", "[1]", "[6]"], {"player_0": 1.0, "player_1": -1.0}),
    "ConnectFour-v0": (
        ["[col 0]", "[col 1]", "[col 0]", "[col 1]", "[col 0]", "[col 1]", "[col 0]"],
        {"player_0": 1.0, "player_1": -1.0},
    ),
}
DRAW = ["[4]", "[0]", "[2]", "[6]", "[3]", "[5]", "[1]", "[7]", "[8]"]  # Tic Tac Toe, the board full


def play_all_seats(game: str, moves: list[str], **kwargs):
    """The game of ``moves`` through AgentEnvLoop (every seat played by the scripted engine) as
    ``rollout_group`` gives it: (the group, the engine)."""
    from doubles import ScriptedEngine

    from agent_r1.flows import AgentEnvLoop, rollout_group
    from agent_r1.types import SamplingParams

    engine = ScriptedEngine(TOKENIZER, moves)
    factory = functools.partial(TextArenaEnv, TOKENIZER, game=game, seats="all", **kwargs)
    flow = AgentEnvLoop(factory, TOKENIZER, SamplingParams(max_tokens=8), max_steps=16)
    group = asyncio.run(rollout_group(flow, engine, {"id": "t", "seed": 0}, 1, "g"))
    return group, engine


@pytest.mark.parametrize("game", sorted(GAMES))
def test_one_game_gives_each_seat_its_own_trajectory_role_and_reward(game):
    from agent_r1.flows import split_roles

    moves, rewards = GAMES[game]
    group, engine = play_all_seats(game, moves)
    player_0, player_1 = group.trajectories
    assert [t.role for t in group.trajectories] == ["player_0", "player_1"]
    # The seats alternate as in the game, each move is in exactly one trajectory, each sampled with
    # its seat's role.
    assert [s.response_text.removesuffix(EOS) for s in player_0.steps] == moves[::2]
    assert [s.response_text.removesuffix(EOS) for s in player_1.steps] == moves[1::2]
    assert [params.role for _, params in engine.calls] == [f"player_{i % 2}" for i in range(len(moves))]
    assert {t.role: t.outcome_reward for t in group.trajectories} == rewards
    assert player_0.info["episode"] == player_1.info["episode"] == "g/0"  # one game
    # each seat's own success: one seat's win is the other's loss
    assert {t.role: t.info["success"] for t in group.trajectories} == {r: v > 0 for r, v in rewards.items()}
    # the game ended for both seats where it ended: each seat's last step is terminal
    assert player_0.steps[-1].terminated and player_1.steps[-1].terminated
    last = player_0.steps[-1]
    assert last.terminated and last.info["reason"] and last.info["rewards"] == {"0": 1.0, "1": -1.0}
    assert last.metrics == {"invalid_actions": 0.0, "player_0_win": 1.0, "player_1_win": 0.0, "draw": 0.0}
    for seat, trajectory in enumerate(group.trajectories):
        prompt = text(trajectory.steps[0].prompt_ids)
        assert f"You are Player {seat}" in prompt and f"You are Player {1 - seat}" not in prompt
        assert {s.info["episode"]["seat"] for s in trajectory.steps} == {seat}
        assert trajectory_view(trajectory, 0, 0)["info"]["seat"] == seat
        # each seat's conversation is its own: a prompt extends the seat's previous prompt + response
        for before, after in zip(trajectory.steps, trajectory.steps[1:], strict=False):
            context = (*before.prompt_ids, *before.response_ids)
            assert after.prompt_ids[: len(context)] == context
    by_role = split_roles([group])
    assert [(g.group_id, g.role, len(g.trajectories)) for g in by_role] == [
        ("g@player_0", "player_0", 1),
        ("g@player_1", "player_1", 1),
    ]


def test_a_drawn_game_gives_both_seats_zero_and_named_roles_are_used():
    group, _ = play_all_seats("TicTacToe-v0", DRAW, seat_roles=["noughts", "crosses"])
    assert {t.role: (len(t.steps), t.outcome_reward) for t in group.trajectories} == {
        "noughts": (5, 0.0),
        "crosses": (4, 0.0),
    }
    last = group.trajectories[0].steps[-1]
    assert last.info["reason"] == "The game is a draw!"
    assert last.metrics == {"invalid_actions": 0.0, "noughts_win": 0.0, "crosses_win": 0.0, "draw": 1.0}


def test_a_seat_that_never_moved_gets_no_trajectory():
    """Seat 0 loses by two invalid moves before seat 1 moves: the outcome names both seats, but only
    seat 0 acted, so only seat 0 has a trajectory (no invented step for seat 1)."""
    _, results, _ = play({"id": "t", "seed": 0}, ["no move", "[99]"], game="TicTacToe-v0", seats="all")
    assert results[0].observation.role == "player_0"  # retried by the same seat
    assert results[-1].outcome_reward == {"player_0": -1.0, "player_1": 1.0}
    group, engine = play_all_seats("TicTacToe-v0", ["no move", "[99]"])
    (trajectory,) = group.trajectories
    assert trajectory.role == "player_0" and trajectory.outcome_reward == -1.0
    assert [s.metrics["invalid_actions"] for s in trajectory.steps] == [1.0, 1.0]
    assert [params.role for _, params in engine.calls] == ["player_0", "player_0"]


def test_invalid_moves_and_max_turns_count_per_seat():
    # Seat 1 tries an occupied cell, then plays; its retry is its own step, counted as its turn.
    _, results, _ = play(
        {"id": "t", "seed": 0}, ["[4]", "[4]", "[0]", "[8]"], game="TicTacToe-v0", seats="all", max_turns=2
    )
    assert [r.metrics["invalid_actions"] for r in results] == [0.0, 1.0, 0.0, 0.0]
    assert [r.info["episode"]["seat"] for r in results] == [0, 1, 1, 0]
    assert [r.info["turn"] for r in results] == [0, 0, 1, 1]
    # Seat 1 has made its 2 moves when it is to move again: truncated, every role's outcome 0.
    last = results[-1]
    assert last.truncated and last.outcome_reward == {"player_0": 0.0, "player_1": 0.0}
    assert last.info["truncated"] == "max_turns=2"
    assert last.info["success"] == {"player_0": False, "player_1": False}
    assert last.metrics == {"invalid_actions": 0.0, "player_0_win": 0.0, "player_1_win": 0.0, "draw": 0.0}


def test_text_mode_prompts_each_seat_with_its_own_wrapper_string():
    first, results, _ = play(
        {"id": "t", "seed": 3}, ["[4]", "[0]"], game="TicTacToe-v0-train", observation="text", seats="all"
    )
    observations = [first, *(r.observation for r in results)]
    assert [o.role for o in observations] == ["player_0", "player_1", "player_0"]
    for seat, observation in zip([0, 1, 0], observations, strict=True):
        assert observation.messages[-1]["content"].startswith(f"You are Player {seat} in Tic Tac Toe.")


def test_all_seats_passes_check_env_and_make_tasks_writes_rows_without_a_seat():
    moves, _ = GAMES["TicTacToe-v0"]
    rows = make_tasks("TicTacToe-v0", [7, 8], seats=None)
    assert rows == [{"id": f"TicTacToe-v0/s{s}", "game": "TicTacToe-v0", "seed": s} for s in (7, 8)]
    factory = functools.partial(TextArenaEnv, TOKENIZER, game="TicTacToe-v0", seats="all")
    check_env(factory, {"id": "t", "seed": 0}, actions=moves, tokenizer=TOKENIZER)
    config = config_from_dict({"env": {"name": "textarena", "kwargs": {"seats": "all"}}})
    assert env_factory(config, TOKENIZER)().all_seats


@pytest.mark.parametrize(
    ("kwargs", "key", "message"),
    [
        ({"seats": "all", "opponent": "random"}, "opponent", r'"random" is given, but with seats: all'),
        ({"seats": "both"}, "seats", r"must be 'row' .* or 'all' .* got 'both'"),
        ({"seat_roles": ["a", "b"]}, "seat_roles", "names the roles of seats: all"),
        ({"seats": "all", "seat_roles": ["a", "a"]}, "seat_roles", r"names a role twice \(\['a', 'a'\]\)"),
        ({"seats": "all", "seat_roles": "ab"}, "seat_roles", "must be a list of role names"),
        ({"seats": "all", "seat_roles": []}, "seat_roles", "must be a list of role names"),
    ],
)
def test_bad_seats_settings_name_the_key(kwargs, key, message):
    from agent_r1.envs.base import EnvKwargsError

    with pytest.raises(EnvKwargsError, match=message) as caught:
        TextArenaEnv.check_kwargs(kwargs)
    assert caught.value.key == key
    with pytest.raises(EnvKwargsError, match=message):
        TextArenaEnv(TOKENIZER, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "task", "message"),
    [
        ({}, {"seat": 1}, r"task t: names seat 1, but with seats: all .* remove 'seat' from the row"),
        (
            {"seat_roles": ["only"]},
            {},
            r"task t: TicTacToe-v0 has 2 seats but env.kwargs.seat_roles names 1 \(\['only'\]\)",
        ),
    ],
)
def test_rows_that_do_not_fit_all_seats_raise_one_clear_error(kwargs, task, message):
    with pytest.raises(ValueError, match=message):
        play({"id": "t", "seed": 0, **task}, [], game="TicTacToe-v0", seats="all", **kwargs)


# ------------------------------------------------------------------------------------ single player


def test_guess_the_number_single_player_hits_with_reward_one_and_counts_invalid_guesses():
    _, results, env = play({"id": "g", "seed": 3}, ["[10]", "guess", "[5]", "[8]"], game="GuessTheNumber-v0")
    assert env.num_players == 1 and env._game.state.game_state["game_number"] == 8
    assert [r.metrics["invalid_actions"] for r in results] == [0.0, 1.0, 0.0, 0.0]
    assert "[GAME] The target number is lower." in last_user(env) or results[-1].terminated
    assert results[-1].outcome_reward == 1.0
    assert results[-1].metrics == {"invalid_actions": 0.0, "win": 1.0, "draw": 0.0, "loss": 0.0}


def test_guess_the_number_out_of_turns_scores_the_games_closeness_and_is_not_a_win():
    # TextArena's GuessTheNumber checks its turn limit before counting the turn: max_turns=2 allows 3.
    kwargs = {"max_number": 15, "max_turns": 2}
    _, results, env = play(
        {"id": "g", "seed": 3}, ["[1]", "[2]", "[3]"], game="GuessTheNumber-v0", game_kwargs=kwargs
    )
    last = results[-1]
    assert env._game.state.game_state["game_number"] == 4 and len(results) == 3
    assert last.terminated and last.outcome_reward == pytest.approx(1 - 1 / 14)
    assert last.metrics["win"] == 0.0 and last.metrics["loss"] == 1.0


def test_the_adapters_own_turn_limit_truncates_with_outcome_zero():
    _, results, _ = play({"id": "g", "seed": 3}, ["[1]", "[2]", "[3]"], game="GuessTheNumber-v0", max_turns=2)
    assert len(results) == 2 and results[-1].truncated and results[-1].outcome_reward == 0.0


@pytest.mark.parametrize("game", ["TicTacToe-v0", "ConnectFour-v0"])
def test_a_game_the_opponent_ends_before_the_seats_first_move_has_no_step(game, monkeypatch):
    """Two invalid opponent moves end the game before seat 1 moves: the seat is never prompted (no
    placeholder prompt, no invented step), and the game's outcome and reason stay on the trajectory."""
    from doubles import ScriptedEngine

    from agent_r1.flows import AgentEnvLoop
    from agent_r1.types import SamplingParams, StepResult

    module = type(sys)("bad_opponent")
    module.move = lambda text: "no move"
    monkeypatch.setitem(sys.modules, "bad_opponent", module)
    kwargs = {"game": game, "opponent": "bad_opponent:move"}
    ended = asyncio.run(TextArenaEnv(TOKENIZER, **kwargs).reset({"id": "t", "seed": 0, "seat": 1}))
    assert isinstance(ended, StepResult) and ended.terminated and ended.outcome_reward == 1.0
    assert ended.info["before_first_move"] is True and ended.info["success"] is True
    assert "format" in ended.info["reason"]  # the game's own words for the opponent's invalid move

    engine = ScriptedEngine(TOKENIZER, ["[4]"])
    flow = AgentEnvLoop(lambda: TextArenaEnv(TOKENIZER, **kwargs), TOKENIZER, SamplingParams(max_tokens=8))
    trajectory = asyncio.run(flow.run(engine, {"id": "t", "seed": 0, "seat": 1}))
    assert trajectory.steps == () and engine.calls == []  # never prompted: nothing to train
    assert trajectory.outcome_reward == 1.0 and trajectory.info["success"] is True
    assert trajectory.info["ended_at_reset"]["reason"] == ended.info["reason"]
    view = trajectory_view(trajectory, 0, 0)
    assert view["reason"] == f"ended before the first action: {ended.info['reason']}"
    check_env(
        lambda: TextArenaEnv(TOKENIZER, **kwargs), {"id": "t", "seed": 0, "seat": 1}, tokenizer=TOKENIZER
    )


def test_a_seed_fixes_the_game_and_the_opponent_and_leaves_the_callers_random_alone():
    random.seed(123)
    outside = random.getstate()

    async def both():
        envs = [TextArenaEnv(TOKENIZER, game="TicTacToe-v0") for _ in range(2)]
        firsts = [await env.reset({"id": "t", "seed": 9, "seat": 1}) for env in envs]
        return [f.token_ids for f in firsts]

    a, b = asyncio.run(both())
    assert a == b and random.getstate() == outside
    games = {
        play({"id": "g", "seed": s}, [], game="GuessTheNumber-v0")[2]._game.state.game_state["game_number"]
        for s in range(6)
    }
    assert len(games) > 1


def test_the_scripted_players_win_and_replay_as_demonstrations():
    factory = functools.partial(TextArenaEnv, TOKENIZER, game="TicTacToe-v0")
    task = make_tasks("TicTacToe-v0", [2], seats=[1])[0]
    moves, result = players.play_scripted(factory, TOKENIZER, task, players.TicTacToePlayer())
    assert result.info["success"] is True
    (demo,) = replay_demonstrations(factory, TOKENIZER, [task], lambda t, rng: moves)
    assert demo.outcome_reward == 1.0 and [s.response_text for s in demo.steps] == moves
    guess = functools.partial(TextArenaEnv, TOKENIZER, game="GuessTheNumber-v0")
    moves, result = players.play_scripted(
        guess, TOKENIZER, {"id": "g", "seed": 3}, players.GuessTheNumberPlayer()
    )
    assert moves == ["[10]", "[5]", "[7]", "[8]"] and result.outcome_reward == 1.0


def test_random_move_picks_a_listed_move():
    rng = random.Random(0)
    board = "Current Board: ...\nAvailable Moves: '[1]', '[5]'\n[Player 0] [4]"
    assert {random_move(board, rng) for _ in range(20)} == {"[1]", "[5]"}
    assert random_move("say [hello]", rng) == "[hello]" and random_move("nothing", rng) == "[0]"


def test_make_tasks_writes_one_row_per_seed_and_seat():
    assert make_tasks("TicTacToe-v0", [7, 8], [0, 1]) == [
        {"id": f"TicTacToe-v0/s{s}/p{p}", "game": "TicTacToe-v0", "seed": s, "seat": p}
        for s in (7, 8)
        for p in (0, 1)
    ]


def test_check_env_registration_and_config():
    check_env(
        functools.partial(TextArenaEnv, TOKENIZER, game="TicTacToe-v0"),
        {"id": "t", "seed": 0, "seat": 0},
        actions=["[4]", "[0]", "[8]"],
        tokenizer=TOKENIZER,
    )
    check_env(
        functools.partial(TextArenaEnv, TOKENIZER, game="GuessTheNumber-v0"),
        {"id": "g", "seed": 3},
        tokenizer=TOKENIZER,
    )
    assert isinstance(make_env("textarena", tokenizer=TOKENIZER), TextArenaEnv)
    config = config_from_dict(
        {"env": {"name": "textarena", "kwargs": {"game": "Nim-v0", "opponent": "random"}}}
    )
    env = env_factory(config, TOKENIZER)()
    assert isinstance(env, TextArenaEnv) and env.default_game == "Nim-v0"


def test_the_viewer_shows_game_and_seat():
    _, results, _ = play({"id": "t", "seed": 0, "seat": 0}, ["[4]", "[0]", "[8]"], game="TicTacToe-v0")
    from agent_r1.types import Step

    steps = tuple(Step((1,), (2,), (0.0,), info=r.info) for r in results)
    view = trajectory_view(Trajectory("t", steps, outcome_reward=1.0, info={"success": True}), 1, 0)
    assert view["info"] == {"game": "TicTacToe-v0", "seat": 0, "num_players": 2, "opponent": "random"}


# ------------------------------------------------------------------------------------------ bad input


def test_a_missing_package_names_the_extra(monkeypatch):
    import importlib

    real = importlib.import_module

    def fake(name, *args):
        if name == "textarena":
            raise ModuleNotFoundError("No module named 'textarena'", name="textarena")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(MissingPackageError, match=r"pip install 'agent-r1\[textarena\]'"):
        TextArenaEnv(TOKENIZER)
    with pytest.raises(MissingPackageError, match="textarena"):
        require("textarena", "textarena", "x")


@pytest.mark.parametrize(
    ("kwargs", "task", "message"),
    [
        (
            {"game": "TicTacToe-v9"},
            {},
            r"unknown TextArena game 'TicTacToe-v9'; its variants: \['TicTacToe-v0'",
        ),
        ({"game": "NoSuchGame-v0"}, {}, r"unknown TextArena game 'NoSuchGame-v0'; games: \[.*'TicTacToe'"),
        (
            {"game": "TicTacToe-v0"},
            {"seat": 2},
            r"task t: seat 2 does not exist in TicTacToe-v0 with 2 player\(s\)",
        ),
        (
            {"game": "TicTacToe-v0", "num_players": 3},
            {},
            r"TicTacToe-v0 refuses num_players 3: The number of players has to be 2",
        ),
        (
            {"game": "GuessTheNumber-v0", "num_players": 2},
            {},
            r"refuses num_players 2: The number of players has to be 1",
        ),
        ({"game": "TicTacToe-v0"}, {"seed": "7"}, r"task t: 'seed' must be an integer"),
        (
            {"game": "TicTacToe-v0", "game_kwargs": {"size": 4}},
            {},
            r"game_kwargs \{'size': 4\} for TicTacToe-v0",
        ),
    ],
)
def test_bad_games_seats_and_rows_raise_one_clear_error(kwargs, task, message):
    with pytest.raises(ValueError, match=message):
        play({"id": "t", **task}, [], **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"opponent": "best"}, "opponent must be 'random', 'self', an entry point"),
        (
            {"opponent": {"openai": {"model": "m"}}},
            r"opponent.openai needs base_url and model \(missing \['base_url'\]\)",
        ),
        ({"opponent": "no_such_module:f"}, "cannot import module 'no_such_module'"),
        ({"observation": "board"}, "observation must be 'chat' or 'text'"),
        ({"max_turns": 0}, "max_turns must be >= 1"),
        ({"context": "windowed"}, "unknown context policy 'windowed'"),
    ],
)
def test_bad_options_raise_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TextArenaEnv(TOKENIZER, **kwargs)


def test_a_multi_player_state_is_not_taken_for_a_single_player_game():
    """TextArena's multi-player states accept one player (PublicGoodsGame then loops forever once
    its one player is eliminated): the probe keeps one player for SinglePlayerState games only."""
    _, _, env = play({"id": "p", "seed": 0}, [], game="PublicGoodsGame-v0")
    assert env.num_players == 2


def test_a_game_call_that_never_returns_times_out(monkeypatch):
    from textarena.envs.TicTacToe.env import TicTacToeEnv

    def forever(self, action):
        while True:
            pass

    monkeypatch.setattr(TicTacToeEnv, "step", forever)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"TicTacToe-v0 did not return within 0.5 s"):
        play({"id": "t", "seed": 0}, ["[4]"], game="TicTacToe-v0", call_timeout_s=0.5)
    assert time.monotonic() - start < 30


def test_a_game_that_cannot_be_imported_here_says_so(monkeypatch):
    # As textarena 0.7.4's Chess, Checkers, Klondike do on Python 3.11 (f-strings of Python 3.12).
    import textarena

    def make(game, **kwargs):
        raise SyntaxError("f-string: unmatched '['")

    monkeypatch.setattr(textarena, "make", make)
    with pytest.raises(ValueError, match=r"TextArena game Chess-v0 cannot be imported here: SyntaxError"):
        play({"id": "c", "seed": 0}, [], game="Chess-v0")


def test_a_game_needing_an_nltk_corpus_fails_at_once_naming_it_and_never_downloads():
    import nltk

    original = nltk.download
    start = time.monotonic()
    with pytest.raises(MissingCorpusError, match=r"'words'.*python -m nltk.downloader words"):
        play({"id": "h", "seed": 0}, [], game="Hangman-v0")
    assert time.monotonic() - start < 30  # a download attempt could hang; this one never starts
    assert nltk.download is original


def test_the_nltk_guard_passes_installed_resources_and_rewrites_nltks_own_lookup_error(tmp_path, monkeypatch):
    import nltk

    (tmp_path / "corpora" / "tiny_corpus").mkdir(parents=True)
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    with ta_env._offline_nltk("G-v0"):
        assert nltk.download("tiny_corpus") is True
        with pytest.raises(MissingCorpusError, match="G-v0.*'absent'"):
            nltk.download(["tiny_corpus", "absent"])
    with pytest.raises(MissingCorpusError, match=r"G-v0.*'stopwords'"), ta_env._offline_nltk("G-v0"):
        from nltk.corpus import stopwords

        stopwords.words("english")


# ------------------------------------------------------------------------------ training end to end


def _warm_start(tmp_path, factory, tasks, player):
    """A tiny model taught by ``player``'s games (a short SFT): it learns the move format."""
    from agent_r1.models.loading import save_model
    from agent_r1.models.tiny import build_tiny
    from agent_r1.train.sft import SFTConfig, sft_sequences, train_sft

    model, tokenizer = build_tiny(seed=0)
    moves = {t["id"]: players.play_scripted(factory, tokenizer, t, player(t))[0] for t in tasks}
    demos = replay_demonstrations(factory, tokenizer, tasks, lambda t, rng: moves[t["id"]])
    train_sft(
        model,
        sft_sequences(demos),
        SFTConfig(epochs=4, batch_size=4, micro_batch_size=4),
        pad_token_id=tokenizer.pad_token_id,
    )
    save_model(model, tokenizer, tmp_path / "sft")
    return tmp_path / "sft"


def _train(model_path, tmp_path, game: str, tasks: list[dict], *, sections=None, **env_kwargs):
    """One RL step through the real Trainer. REINFORCE++ whitens returns over the whole batch, so
    tasks with different outcomes give an update even when each task's samples agree (as a barely
    trained tiny model's do). ``sections``: more config sections (several policies)."""
    from agent_r1.train.trainer import Trainer

    sections = dict(sections or {})
    config = config_from_dict(
        {
            "policies": sections.pop("policies", {}),
            "model": {"path": str(model_path), **sections.pop("model", {})},
            "env": {"name": "textarena", "kwargs": {"game": game, **env_kwargs}},
            "rollout": {"n": 2, "max_tokens": 4, "max_steps": 6, "temperature": 1.0},
            "algorithm": {"advantage": "reinforce_pp"},
            "trainer": {
                "steps": 1,
                "tasks_per_step": len(tasks),
                "lr": 1e-3,
                "run_dir": str(tmp_path / "run"),
            },
            "logging": {"progress": False, "report": False},
        }
    )
    trainer = Trainer(config, train_tasks=tasks)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.fit()
    changed = any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    dumps = sorted((tmp_path / "run" / "trajectories").glob("step_*.jsonl"))
    return metrics, changed, _dumped(dumps)


def _dumped(dumps) -> list[Trajectory]:
    out = []
    for path in dumps:
        for record in read_jsonl(path):
            out.extend(getattr(record, "trajectories", (record,)))
    return out


def test_trains_a_two_player_game_in_self_play_one_trajectory_per_seat(tiny_checkpoint, tmp_path):
    """Both seats of one game, the other seat played by the policy itself (lent by AgentEnvLoop).
    The untrained model loses seat 0 by two invalid moves; seat 1 then wins before it moves, so its
    trajectories have no step (nothing to train) and keep the game's outcome. A GuessTheNumber row
    (a task row may name its game) gives the batch a second outcome, so the update is not zero."""
    tasks = [*make_tasks("TicTacToe-v0", [0], seats=[0, 1]), *make_tasks("GuessTheNumber-v0", [0])]
    metrics, changed, trajectories = _train(
        tiny_checkpoint, tmp_path, "TicTacToe-v0", tasks, opponent="self", max_turns=3
    )
    assert changed
    for name in ("env/invalid_actions", "env/win", "env/draw", "env/loss"):
        assert name in metrics and 0.0 <= metrics[name] <= 1.0
    assert len(trajectories) == 6  # (2 seats + 1 game) x n=2
    by_seat = {0: [], 1: []}
    for t in trajectories:
        if t.task_id.startswith("GuessTheNumber"):
            continue
        episode = (t.steps[0].info if t.steps else t.info["ended_at_reset"])["episode"]
        assert episode["opponent"] == "self" and t.task_id == f"TicTacToe-v0/s0/p{episode['seat']}"
        assert all("invalid_actions" in s.metrics for s in t.steps)
        by_seat[episode["seat"]].append((len(t.steps), t.outcome_reward))
    assert by_seat == {0: [(2, -1.0), (2, -1.0)], 1: [(0, 1.0), (0, 1.0)]}
    seat_1 = next(t for t in trajectories if t.task_id.endswith("/p1"))
    assert seat_1.info["success"] is True and seat_1.info["ended_at_reset"]["before_first_move"] is True


@pytest.mark.parametrize("per_seat", [False, True], ids=["shared_policy", "policy_per_seat"])
def test_trains_both_seats_from_one_game(tmp_path, per_seat):
    """``seats: all`` through the real Trainer (issue 50): each game is one episode giving a trajectory
    per seat that moved, grouped by (task, seat); one shared policy trains from both seats' groups, or
    each seat's LoRA adapter from its own."""
    factory = functools.partial(TextArenaEnv, TOKENIZER, game="TicTacToe-v0", opponent="random")
    demos = make_tasks("TicTacToe-v0", range(100, 108), seats=[0, 1])
    model_path = _warm_start(tmp_path, factory, demos, lambda t: players.TicTacToePlayer())
    sections = {}
    if per_seat:
        sections = {"model": {"lora": {"rank": 4, "alpha": 8}}, "policies": {"player_0": {}, "player_1": {}}}
    tasks = make_tasks("TicTacToe-v0", [1, 2, 3], seats=None)
    metrics, changed, trajectories = _train(
        model_path, tmp_path, "TicTacToe-v0", tasks, sections=sections, seats="all", max_turns=5
    )
    assert changed
    episodes: dict[str, list] = {}
    for t in trajectories:
        assert t.group_id.endswith(f"@{t.role}")  # groups are (task, seat)
        assert {s.info["episode"]["seat"] for s in t.steps} == {int(t.role[-1])}  # only its own moves
        episodes.setdefault(t.info["episode"], []).append(t.role)
    assert len(episodes) == len(tasks) * 2  # every game played once (n=2), not once per seat
    assert all(len(set(roles)) == len(roles) for roles in episodes.values())  # a trajectory per seat
    # the barely warmed-up model often loses seat 0 on two invalid moves, before seat 1 moves: that
    # seat gets no trajectory; in the games it reached, seat 1 was trained too
    assert any(roles == ["player_0", "player_1"] for roles in episodes.values())
    for role in ("player_0", "player_1"):
        assert f"role/{role}/reward/mean" in metrics
        assert (f"policy/{role}/loss/policy" in metrics) is per_seat
    assert ("loss/policy" in metrics) is not per_seat


def test_trains_a_single_player_game(tmp_path):
    kwargs = {"game_kwargs": {"max_number": 15, "max_turns": 2}}
    factory = functools.partial(TextArenaEnv, TOKENIZER, game="GuessTheNumber-v0", **kwargs)
    demos = make_tasks("GuessTheNumber-v0", range(100, 116))
    model_path = _warm_start(
        tmp_path, factory, demos, lambda t: players.GuessTheNumberPlayer(0.3, seed=t["seed"])
    )
    tasks = make_tasks("GuessTheNumber-v0", [1, 2, 3, 4])  # 8 games: a win and a loss among them
    metrics, changed, trajectories = _train(model_path, tmp_path, "GuessTheNumber-v0", tasks, **kwargs)
    assert len({t.outcome_reward for t in trajectories}) > 1  # the games differ, so the batch teaches
    assert changed and {"env/invalid_actions", "env/win", "env/loss"} <= set(metrics)
    assert metrics["env/draw"] == 0.0
    assert len(trajectories) == 8 and all(
        t.steps[0].info["episode"]["num_players"] == 1 for t in trajectories
    )


@pytest.mark.slow
def test_benchmark_arm_quick_runs_both_games(monkeypatch):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "eco_textarena.py"
    monkeypatch.syspath_prepend(str(path.parent))  # the arm imports its neighbour run_digest by name
    spec = importlib.util.spec_from_file_location("eco_textarena", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.run(seed=0, quick=True)
    assert {"env", "metric", "before", "after", "tasks", "rl_steps", "seconds"} <= set(result)
    assert result["env"] == "textarena:TicTacToe-v0" and "win rate vs random" in result["metric"]
    assert [arm["env"] for arm in result["arms"]] == ["textarena:TicTacToe-v0", "textarena:GuessTheNumber-v0"]
    for arm in result["arms"]:
        assert 0.0 <= arm["before"] <= 1.0 and 0.0 <= arm["after"] <= 1.0 and arm["rl_steps"] == 1
