"""Multi-turn environments driven by a scripted model that emits tool calls.

The model is a script of turn texts; it records every token list it was asked
to continue, so the tests can check the one-sequence rule: each turn's input
is an exact prefix of the next, model tokens are kept as generated (mask 1,
their log-probs and versions), environment tokens have mask 0.
"""

from __future__ import annotations

import itertools
import json
import operator
import threading
import time
from pathlib import Path

import pytest

from asyncrl.config.environment import EnvironmentConfig
from asyncrl.generation.envs import (
    ChatMLFormatter,
    Codec,
    EpisodeRunner,
    PlainTextFormatter,
    PluginError,
    ScoreRequest,
    StepPool,
    StepResult,
    Tool,
    ToolEnvironment,
    environment_factory,
    load_environment,
    run_episode,
)
from asyncrl.generation.envs.calculator import CalculatorError, calculate
from asyncrl.generation.envs.tool_env import default_score
from asyncrl.generation.envs.tools import validate
from tests.helpers.waiting import wait_until

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "custom_env.py"

CHARS = Codec(encode=lambda text: [ord(c) for c in text], decode=lambda ids: "".join(map(chr, ids)))
PLAIN = PlainTextFormatter()


def pair_codec() -> Codec:
    """Merges each pair of characters into one token, so encode(a) + encode(b) is
    generally not encode(a + b): re-tokenizing a conversation would drift."""

    def encode(text):
        return [
            ord(text[i]) * 0x110000 + ord(text[i + 1]) if i + 1 < len(text) else ord(text[i])
            for i in range(0, len(text), 2)
        ]

    def decode(ids):
        return "".join(
            chr(t) if t < 0x110000 else chr(t // 0x110000) + chr(t % 0x110000) for t in ids
        )

    return Codec(encode, decode)


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class ScriptedModel:
    """Says its turns in order; its weights get one version newer per turn."""

    def __init__(self, turns, codec=CHARS, end="<end>"):
        self.turns, self.codec, self.end = list(turns), codec, end
        self.inputs: list[list[int]] = []
        self.outputs: list[list[int]] = []

    def __call__(self, token_ids, max_new_tokens, stop):
        assert self.end in stop
        self.inputs.append(list(token_ids))
        text = self.turns.pop(0) + self.end
        ids = self.codec.encode(text)[:max_new_tokens]
        self.outputs.append(ids)
        version = len(self.inputs) - 1
        return ids, [-0.25] * len(ids), [version] * len(ids)

    def saw(self, turn: int) -> str:
        return self.codec.decode(self.inputs[turn])


ROW = {
    "prompt": [{"role": "user", "content": "What is 6 * 7?"}],
    "data_source": "test/arith",
    "reward_model": {"ground_truth": "42"},
    "extra_info": {"index": 3},
}


def episode(turns, env=None, codec=CHARS, **limits):
    env = env or ToolEnvironment(["calculator"])
    model = ScriptedModel(turns, codec)
    return run_episode(env, ROW, model, codec, PLAIN, **limits), model


def test_a_tool_call_then_an_answer():
    trajectory, model = episode([call("calculator", expression="6 * 7"), "42"])
    assert trajectory.finish_reason == "stop"
    assert trajectory.reward == 1.0
    assert (trajectory.num_turns, trajectory.tool_calls, trajectory.tool_errors) == (2, 1, 0)
    assert model.saw(1).endswith("<end>\ntool: 42\nassistant: ")


def test_system_prompt_lists_tool_schemas_and_the_call_format():
    env = ToolEnvironment(["calculator"])
    system, user = env.reset(ROW)
    assert system["role"] == "system" and user == ROW["prompt"][0]
    assert json.dumps(env.tools["calculator"].schema()) in system["content"]
    assert "<tool_call>" in system["content"]
    own = {"prompt": [{"role": "system", "content": "Be brief."}, *ROW["prompt"]]}
    merged = env.reset(own)
    assert merged[0]["content"].startswith("Be brief.\n\n# Tools") and len(merged) == 2


def test_malformed_call_is_an_error_message_and_the_episode_goes_on():
    broken = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"</tool_call>'
    trajectory, model = episode([broken, call("calculator", expression="6*7"), "42"])
    assert "tool: Error: the tool call is not valid JSON" in model.saw(1)
    assert model.saw(2).endswith("tool: 42\nassistant: ")
    assert (trajectory.finish_reason, trajectory.reward) == ("stop", 1.0)
    assert (trajectory.tool_calls, trajectory.tool_errors) == (2, 1)


def test_unknown_tool_and_bad_arguments_are_error_messages():
    turns = [call("search", query="x"), call("calculator", expr="1"), call("calculator"), "42"]
    trajectory, model = episode(turns)
    assert "tool: Error: unknown tool 'search'; available: calculator" in model.saw(1)
    assert "unexpected argument 'expr'" in model.saw(2)
    assert "missing required argument 'expression'" in model.saw(3)
    assert (trajectory.tool_calls, trajectory.tool_errors, trajectory.reward) == (3, 3, 1.0)


def test_a_tool_that_raises_is_an_error_message_not_a_crash():
    def broken(**_):
        raise RuntimeError("disk on fire")

    tool = Tool("broken", "always fails", {"type": "object"}, broken)
    trajectory, model = episode([call("broken"), "42"], env=ToolEnvironment([tool]))
    assert "Error: broken failed: RuntimeError: disk on fire" in model.saw(1)
    assert trajectory.tool_errors == 1 and trajectory.reward == 1.0


def test_calls_beyond_the_per_turn_limit_are_refused():
    env = ToolEnvironment(["calculator"], max_calls_per_turn=2)
    trajectory, model = episode([call("calculator", expression="1") * 3, "42"], env=env)
    assert model.saw(1).count("tool: 1\n") == 2
    assert "at most 2 tool calls per turn" in model.saw(1)
    assert (trajectory.tool_calls, trajectory.tool_errors) == (3, 1)


def test_turn_limit_ends_the_episode_without_running_the_last_turns_tools():
    runs = []
    tool = Tool("count", "counts", {"type": "object"}, lambda: runs.append(1) or str(len(runs)))
    env = ToolEnvironment([tool], max_turns=3)
    trajectory, model = episode([call("count")] * 5, env=env, max_turns=3)
    assert (trajectory.finish_reason, trajectory.num_turns, len(model.inputs)) == (
        "max_turns",
        3,
        3,
    )
    assert trajectory.reward == 0.0
    assert len(runs) == 2  # the third turn's call could never be shown to the model
    assert trajectory.tool_calls == 3
    assert trajectory.spans[-1][2] == "model"


def test_token_limit_cuts_a_long_turn():
    trajectory, model = episode(["4" * 5000], max_total_tokens=1000)
    assert trajectory.finish_reason == "length"
    assert len(trajectory.token_ids) == 1000
    assert len(model.outputs[0]) == 1000 - trajectory.prompt_len
    assert trajectory.reward == 0.0


def test_token_limit_on_a_tool_reply_ends_the_episode_before_appending_it():
    first, _ = episode([call("calculator", expression="6*7"), "42"])
    limit = first.spans[1][1]  # exactly up to the end of the tool reply: no room left
    trajectory, _ = episode([call("calculator", expression="6*7"), "42"], max_total_tokens=limit)
    assert (trajectory.finish_reason, trajectory.num_turns) == ("length", 1)
    assert trajectory.token_ids == first.token_ids[: first.spans[0][1]]
    assert trajectory.tool_calls == 1


def test_per_turn_token_limit():
    trajectory, model = episode(["4" * 50], max_tokens_per_turn=10)
    assert (trajectory.finish_reason, len(model.outputs[0])) == ("length", 10)


def test_a_prompt_over_the_budget_ends_before_any_turn():
    trajectory, model = episode(["42"], max_total_tokens=50)
    assert (trajectory.finish_reason, trajectory.num_turns, model.inputs) == ("length", 0, [])


@pytest.mark.parametrize("codec", [CHARS, pair_codec()], ids=["chars", "merging-pairs"])
def test_prefix_never_changes_and_only_model_tokens_are_trained(codec):
    turns = [
        "Let me check. " + call("calculator", expression="6*7"),
        call("search", q=1),
        '<tool_call>{"name": oops</tool_call>',
        call("calculator", expression="42 / 1"),
        "42",
    ]
    trajectory, model = episode(turns, codec=codec, max_turns=8)
    assert trajectory.finish_reason == "stop" and trajectory.num_turns == 5

    # Every input the model saw is an exact prefix of the next and of the end result.
    sequences = [*model.inputs, trajectory.token_ids]
    for before, after in itertools.pairwise(sequences):
        assert after[: len(before)] == before
    assert model.inputs[0] == trajectory.prompt_ids
    if codec is not CHARS:  # re-tokenizing the whole conversation would have drifted
        assert codec.encode(codec.decode(trajectory.token_ids)) != trajectory.token_ids

    # Response arrays line up with token_ids[prompt_len:].
    response = len(trajectory.token_ids) - trajectory.prompt_len
    assert (
        len(trajectory.loss_mask)
        == len(trajectory.logprobs)
        == len(trajectory.versions)
        == response
    )

    # Model spans are the model's own ids, mask 1, with its log-probs and versions;
    # environment spans have mask 0, log-prob 0 and version -1.
    spans = trajectory.spans
    assert [kind for _, _, kind in spans] == ["model", "env"] * 4 + ["model"]
    assert spans[0][0] == trajectory.prompt_len and spans[-1][1] == len(trajectory.token_ids)
    for index, (start, end, kind) in enumerate(spans):
        a, b = start - trajectory.prompt_len, end - trajectory.prompt_len
        if kind == "model":
            turn = index // 2
            assert trajectory.token_ids[start:end] == model.outputs[turn]
            assert set(trajectory.loss_mask[a:b]) == {1}
            assert set(trajectory.logprobs[a:b]) == {-0.25}
            assert set(trajectory.versions[a:b]) == {turn}
        else:
            assert set(trajectory.loss_mask[a:b]) == {0}
            assert set(trajectory.logprobs[a:b]) == {0.0}
            assert set(trajectory.versions[a:b]) == {-1}
    assert trajectory.min_version == 0
    assert sorted(set(trajectory.versions)) == [-1, 0, 1, 2, 3, 4]


def test_chatml_replies_close_the_turn_only_when_the_model_did_not():
    formatter = ChatMLFormatter()
    tool = [{"role": "tool", "content": "4"}, {"role": "tool", "content": "5"}]
    expected = (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n"
        "<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert formatter.render_reply(tool, "x<|im_end|>") == expected
    assert formatter.render_reply(tool, "x") == "<|im_end|>" + expected
    user = formatter.render_reply([{"role": "user", "content": "Lower."}], "x<|im_end|>")
    assert user == "\n<|im_start|>user\nLower.<|im_end|>\n<|im_start|>assistant\n"
    prompt = formatter.render_prompt([{"role": "system", "content": "S"}, ROW["prompt"][0]])
    assert prompt == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_runner_with_given_prompt_ids_and_a_backend_finish_reason():
    runner = EpisodeRunner(ToolEnvironment(["calculator"]), ROW, CHARS, PLAIN, prompt_ids=[1, 2, 3])
    request = runner.request()
    assert request.token_ids == [1, 2, 3] and request.stop == ["<end>"]
    ids = CHARS.encode(call("calculator", expression="6*7"))  # no end marker: a cut stop string
    runner.submit(ids, [0.0] * len(ids), [7] * len(ids), "stop")
    reply = CHARS.decode(runner.token_ids[3 + len(ids) :])
    assert reply == "<end>\ntool: 42\nassistant: "  # the reply closes the turn
    with pytest.raises(ValueError, match="must match"):
        runner.submit([1, 2], [0.0], [7, 7])
    runner.submit([52, 50], [0.0, 0.0], [8, 8], "length")
    assert runner.done and runner.result().finish_reason == "length"
    with pytest.raises(RuntimeError, match="over"):
        runner.request()


def test_python_tool_runs_code_in_the_sandbox():
    env = ToolEnvironment(["python"], python_timeout_s=2, python_memory_mb=256)
    code = call("python", code="print(6 * 7)\nimport sys; print('warn', file=sys.stderr)")
    trajectory, model = episode([code, call("python", code="1/0"), "42"], env=env)
    assert "tool: 42\n[stderr]\nwarn\n" in model.saw(1)
    assert "ZeroDivisionError" in model.saw(2) and "[exit code 1]" in model.saw(2)
    assert trajectory.reward == 1.0 and trajectory.tool_errors == 0


def test_calculator():
    assert calculate("2 * (3 + 4) ** 2") == "98"
    assert calculate("0.1 + 0.2") == "0.3"
    assert calculate("sqrt(16) + log(8, 2) - abs(-1)") == "6"
    assert calculate("-7 % 3") == "2" and calculate("10 ** 20") == "1" + "0" * 20
    for bad, message in [
        ("__import__('os')", "unknown function '__import__'"),
        ("__import__('os').system('x')", "Call is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("'a' * 3", "only numbers"),
        ("1 / 0", "ZeroDivisionError"),
        ("2 ** 100000", "exponent too large"),
        ("9 ** 999 * 9 ** 999 * 9 ** 999", "result too large"),
        ("[x for x in (1,)]", "not allowed"),
        ("1 +", "invalid expression"),
    ]:
        with pytest.raises(CalculatorError, match=message.replace("(", r"\(")):
            calculate(bad)
    try:  # deep nesting: an answer or a CalculatorError, never a RecursionError
        assert calculate("-" * 998 + "1") == "1"
    except CalculatorError as exc:
        assert "nested" in str(exc)


def test_tool_schema_is_openai_style_and_arguments_are_checked():
    schema = ToolEnvironment(["calculator"]).tools["calculator"].schema()
    assert schema["type"] == "function"
    assert set(schema["function"]) == {"name", "description", "parameters"}
    assert schema["function"]["parameters"]["required"] == ["expression"]
    spec = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 1},
            "mode": {"enum": ["a", "b"]},
            "xs": {"type": "array", "items": {"type": "number"}},
        },
        "required": ["n"],
    }
    assert validate(spec, {"n": 2, "mode": "a", "xs": [1, 2.5]}) == []
    assert validate(spec, {"n": True}) == ["arguments.n should be integer, got bool"]
    assert validate(spec, {"n": 0, "mode": "c", "xs": ["x"]}) == [
        "arguments.n should be >= 1",
        "arguments.mode should be one of ['a', 'b']",
        "arguments.xs[0] should be number, got str",
    ]


def test_scorers():
    assert default_score("d", r"so \boxed{42.0}", "42") == 1.0
    assert default_score("d", "41", "42") == 0.0
    assert default_score("d", "Paris", "Paris") == 1.0
    # a data_source with a built-in reward function is scored by it
    assert default_score("openai/gsm8k", "so 6 * 7 = 42\n#### 42", "42") == 1.0
    assert default_score("openai/gsm8k", r"\boxed{42}", "42") == 0.0  # gsm8k wants ####
    seen = []

    def score(data_source, solution_str, ground_truth, extra_info):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return {"score": 0.5, "acc": False}

    trajectory, _ = episode(["the answer: 42"], env=ToolEnvironment([], compute_score=score))
    assert trajectory.reward == 0.5
    assert seen == [("test/arith", "the answer: 42", "42", {"index": 3})]
    env = ToolEnvironment([], compute_score="asyncrl.generation.envs.tool_env:default_score")
    assert env.compute_score is default_score


def test_example_environment_from_scratch():
    source = EXAMPLE.read_text().splitlines()
    assert len(source) < 60
    env = load_environment(f"{EXAMPLE}:GuessNumberEnv", low=1, high=100)
    row = {"reward_model": {"ground_truth": 37}}
    model = ScriptedModel(["50", "I think 25", "hmm", "37"])
    trajectory = run_episode(env, row, model, CHARS, PLAIN, max_turns=6)
    assert "from 1 to 100" in model.saw(0)
    assert model.saw(1).endswith("user: Lower.\nassistant: ")
    assert model.saw(2).endswith("user: Higher.\nassistant: ")
    assert model.saw(3).endswith("user: Answer with a whole number.\nassistant: ")
    assert (trajectory.finish_reason, trajectory.num_turns) == ("stop", 4)
    assert trajectory.reward == pytest.approx(0.7)


class NotAnEnvironment:
    pass


class Echo:
    """Duck-typed: no base class, just reset and step."""

    def __init__(self, word="done"):
        self.word = word

    def reset(self, row):
        return [{"role": "user", "content": "say " + self.word}]

    def step(self, response):
        return StepResult(done=True, reward=float(response == self.word))


def test_load_environment_by_name_and_its_errors():
    assert isinstance(load_environment("tools", tools=["calculator"]), ToolEnvironment)
    echo = load_environment(f"{__name__}:Echo", word="hi")
    assert echo.word == "hi"
    for spec, message in [
        ("nope", "expected one of tools"),
        ("no_such_module_xyz:Env", "no module named 'no_such_module_xyz'"),
        (f"{__name__}:Missing", "has no attribute 'Missing'"),
        (f"{__name__}:NotAnEnvironment", "neither subclasses"),
        (f"{__name__}:call", "not a class"),
        ("/nonexistent/env.py:Env", "no file"),
    ]:
        with pytest.raises(PluginError, match=message):
            load_environment(spec)
    with pytest.raises(PluginError, match=r"Echo\(\*\*\['colour'\]\) failed"):
        load_environment(f"{__name__}:Echo", colour="red")
    with pytest.raises(PluginError, match="unknown tool 'abacus'"):
        load_environment("tools", tools=["abacus"])


def test_environment_config_and_factory():
    config = EnvironmentConfig(name="tools")
    assert (config.tools, config.max_turns, config.max_total_tokens) == (
        ["calculator", "python"],
        4,
        2048,
    )
    with pytest.raises(ValueError, match="name"):
        EnvironmentConfig()
    with pytest.raises(ValueError, match="module:Class"):
        EnvironmentConfig(name="guess")
    with pytest.raises(ValueError, match="extra"):
        EnvironmentConfig(name="tools", max_turn=3)

    config = EnvironmentConfig(
        name="tools", max_turns=2, python_timeout_s=1, kwargs={"max_calls_per_turn": 1}
    )
    make = environment_factory(config)
    first, second = make(), make()
    assert first is not second
    assert list(first.tools) == ["calculator", "python"]
    assert (first.max_turns, first.max_calls_per_turn) == (2, 1)

    custom = environment_factory(
        EnvironmentConfig(name=f"{EXAMPLE}:GuessNumberEnv", kwargs={"high": 10})
    )
    assert custom().high == 10
    with pytest.raises(PluginError):
        environment_factory(EnvironmentConfig(name="no_such_module_xyz:Env"))


def test_the_python_tools_isolation_setting(caplog):
    from asyncrl.generation.envs import check_isolation_for
    from asyncrl.generation.envs.factory import python_sandbox

    config = EnvironmentConfig(name="tools", python_timeout_s=2, python_memory_mb=128)
    assert config.python_isolation == "bubblewrap"
    sandbox = python_sandbox(config)
    assert (sandbox.isolation, sandbox.timeout_s, sandbox.memory_mb) == ("bubblewrap", 2, 128)
    with pytest.raises(ValueError, match=r"python_isolation must be 'bubblewrap'.*or 'none'"):
        EnvironmentConfig(name="tools", python_isolation="off")
    assert python_sandbox(EnvironmentConfig(name="tools", tools=["calculator"])) is None
    assert python_sandbox(EnvironmentConfig(name=f"{EXAMPLE}:GuessNumberEnv")) is None

    # The launcher's check: a probe where the tool is sandboxed, nothing otherwise.
    check_isolation_for(config)
    check_isolation_for(EnvironmentConfig(name="tools", tools=["calculator"]))

    trusted = EnvironmentConfig(name="tools", tools=["python"], python_isolation="none")
    with caplog.at_level("WARNING", logger="asyncrl.envs.sandbox"):
        assert check_isolation_for(trusted) is None
        env = environment_factory(trusted)()
    assert "ISOLATION IS OFF" in caplog.text
    assert "no network" not in env.tools["python"].description
    assert env.tools["python"].call({"code": "print(6 * 7)"}) == "42"


def test_check_isolation_for_refuses_when_bubblewrap_is_missing(monkeypatch):
    from types import SimpleNamespace

    from asyncrl.generation.envs import SandboxUnavailable, check_isolation_for
    from asyncrl.generation.envs.sandbox import checks as sandbox_checks
    from asyncrl.generation.envs.sandbox import runner as sandbox_runner

    monkeypatch.setattr(sandbox_runner, "bwrap_path", lambda name: None)
    # a sandbox that passed once is not probed again in a process: forget the ones
    # that earlier tests (a shipped config with the python tool) saw pass
    monkeypatch.setattr(sandbox_checks, "_CHECKED", set())
    run = SimpleNamespace(environment=EnvironmentConfig(name="tools", tools=["python"]))
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        check_isolation_for(run)
    assert check_isolation_for(SimpleNamespace(environment=None)) is None
    env = environment_factory(run.environment)()  # builds; each call refuses to run code
    output = env.tools["python"].call({"code": "print(1)"})
    assert "the code was not run" in output and output.endswith("[not run]")


def test_a_named_reward_function_can_be_left_to_the_driver():
    """``defer_score``: the final answer comes back as a ScoreRequest (the replica's
    reward workers score it); a Python callable has no name, so it is still called."""
    env = ToolEnvironment([], defer_score=True)
    env.reset(ROW)
    result = env.step("the answer: 42")
    assert result.done and result.reward == 0.0
    assert result.score_request == ScoreRequest(
        "asyncrl.generation.envs.tool_env:default_score",
        "the answer: 42",
        "test/arith",
        "42",
        {"index": 3},
    )
    assert result.score_request.score_here() == 0.0  # default_score: the whole text != 42
    gsm8k = "asyncrl.generation.rewards:gsm8k_score"
    named = ToolEnvironment([], compute_score=gsm8k, defer_score=True)
    named.reset(ROW)
    assert named.step("#### 42").score_request.function == "asyncrl.generation.rewards:gsm8k_score"
    called = ToolEnvironment([], compute_score=lambda *args: 0.5, defer_score=True)
    called.reset(ROW)
    assert called.step("42").reward == 0.5 and called.step("42").score_request is None
    make = environment_factory(EnvironmentConfig(name="tools"), defer_score=True)
    assert (
        make().defer_score
        and not environment_factory(EnvironmentConfig(name="tools"))().defer_score
    )


class AnswerScoredElsewhere(Echo):
    def step(self, response):
        request = ScoreRequest("asyncrl.generation.rewards:gsm8k_score", response, "gsm8k", "42")
        return StepResult(done=True, reward=0.5, score_request=request)


def test_a_score_request_is_scored_in_place_or_left_for_the_caller():
    trajectory, _ = episode(["so #### 42"], env=AnswerScoredElsewhere())
    assert trajectory.reward == 1.5  # the step's own reward plus the function's score
    runner = EpisodeRunner(AnswerScoredElsewhere(), ROW, CHARS, PLAIN, defer_scoring=True)
    ids = CHARS.encode("#### 42<end>")
    runner.submit(ids, [0.0] * len(ids), [0] * len(ids))
    assert runner.done and runner.reward == 0.5
    assert runner.score_request.solution_str == "#### 42"


def test_step_pool_replaces_abandoned_threads_up_to_a_limit():
    pool = StepPool(1, max_stuck=1, name="test-steps")
    first, second = threading.Event(), threading.Event()
    try:
        stuck = pool.submit(first.wait, 30)
        wait_until(lambda: stuck.started_at is not None, every_s=0.005)
        assert pool.abandon(stuck) and (pool.stuck, pool.abandoned) == (1, 1)
        # the only worker is stuck, but a new thread runs the next call
        assert pool.submit(pow, 2, 5).future.result(timeout=30) == 32
        again = pool.submit(second.wait, 30)
        wait_until(lambda: again.started_at is not None, every_s=0.005)
        assert pool.abandon(again) and pool.stuck == 2 and pool.stalled
        queued = pool.submit(pow, 2, 6)  # no thread may start: it waits until abandoned
        time.sleep(0.05)
        assert queued.started_at is None and pool.abandon(queued) and queued.future.cancelled()
        first.set()  # a stuck call returns: its thread ends, and one may start again
        wait_until(lambda: not pool.stalled, every_s=0.005)
        assert pool.submit(pow, 2, 7).future.result(timeout=30) == 128
        done = pool.submit(pow, 2, 1)
        done.future.result(timeout=30)
        assert not pool.abandon(done)  # finished already: nothing to give up
        failed = pool.submit(operator.truediv, 1, 0)
        assert isinstance(failed.future.exception(timeout=30), ZeroDivisionError)
        assert all(t.daemon for t in threading.enumerate() if t.name.startswith("test-steps"))
    finally:
        second.set()
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(pow, 2, 2)
    wait_until(
        lambda: not any(t.name.startswith("test-steps") for t in threading.enumerate()),
        every_s=0.005,
    )


def test_step_timeout_is_validated():
    assert EnvironmentConfig(name="tools").step_timeout_s == 60
    assert EnvironmentConfig(name="tools", step_timeout_s=0.5).step_timeout_s == 0.5
    for bad in (0, -1, "soon"):
        with pytest.raises(ValueError, match="step_timeout_s"):
            EnvironmentConfig(name="tools", step_timeout_s=bad)


def test_the_tool_listing_can_be_replaced_or_left_out():
    short = 'Call it as <tool_call>{"name": ..., "arguments": ...}</tool_call>. Tools: {schemas}'
    system, _ = ToolEnvironment(["calculator"], tools_prompt=short).reset(ROW)
    schema = json.dumps(ToolEnvironment(["calculator"]).tools["calculator"].schema())
    listing = short.replace("{schemas}", schema)
    assert system["content"] == f"You are a helpful assistant.\n\n{listing}"
    system, _ = ToolEnvironment(["calculator"], tools_prompt="", system_prompt="Hi.").reset(ROW)
    assert system["content"] == "Hi."
    default, _ = ToolEnvironment(["calculator"]).reset(ROW)
    assert '{"name": <function-name>, "arguments": <args-json-object>}' in default["content"]
