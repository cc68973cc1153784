"""The `openai-agents` SDK against the gateway, through chat completions and the Responses API.

The tiny model writes random tokens (greedy: newlines), so the fast tests end each reply with a
stop string and check the protocol path and the token log; the slow SmolLM2 test runs an agent
with a tool for real, read against the engine's own record (tests/engine_oracle.py).
"""

from __future__ import annotations

import pytest
from agents import (
    Agent,
    ModelBehaviorError,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from engine_oracle import RecordingEngine, assert_token_in_token_out, check_trajectory

from gateway.engines.local import LocalEngine
from gateway.server import Gateway, GatewayConfig

set_tracing_disabled(True)


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
async def gateway(engine, tiny_model_path):
    gw = Gateway(engine, tiny_model_path, GatewayConfig(auth="keys"))
    yield gw
    await gw.aclose()


MODELS = {"chat": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("streamed", [False, True])
async def test_agent_runs_through_gateway(gateway, api, streamed):
    sid, key = gateway.create_session()
    model = MODELS[api](model="tiny-random", openai_client=gateway.openai_client(key))
    settings = ModelSettings(temperature=1.0, max_tokens=24, extra_body={"stop": ["e"], "seed": 3})
    agent = Agent(name="adder", instructions="You add.", tools=[add], model=model,
                  model_settings=settings)  # fmt: skip
    if streamed:
        result = Runner.run_streamed(agent, "What is 1 + 2?", max_turns=2)
        deltas = []
        async for event in result.stream_events():
            if event.type == "raw_response_event":
                data = event.data
                deltas.append(getattr(data, "delta", None) or "")
        final = result.final_output
    else:
        result = await Runner.run(agent, "What is 1 + 2?", max_turns=2)
        final = result.final_output
    traj = gateway.trajectory(sid)
    (turn,) = traj.turns
    logged = gateway.renderer.decode(turn.output_ids)
    # the reply is the logged text up to the stop string
    assert final == logged[: logged.index("e")] if "e" in logged else final == logged
    prompt = gateway.renderer.decode(turn.prompt_ids)
    assert "You add." in prompt and '"name": "add"' in prompt and "What is 1 + 2?" in prompt
    if streamed:
        assert "".join(d for d in deltas if isinstance(d, str)) == final


@pytest.mark.slow
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_smollm2_agent_with_tool(smollm2_path, api):
    """SmolLM2 calls the tool for real (forced), the SDK runs it, and a second run answers from
    the tool's output. Read against the engine's record:
    one segment holding both replies, the tool result in it untrained."""
    engine = RecordingEngine(LocalEngine(smollm2_path))
    gw = Gateway(engine, smollm2_path, GatewayConfig(auth="keys"), model_name="smollm2")
    try:
        sid, key = gw.create_session()
        model = MODELS[api](model="smollm2", openai_client=gw.openai_client(key))
        caller = Agent(
            name="adder",
            instructions="Use the add tool to add numbers.",
            tools=[add],
            model=model,
            model_settings=ModelSettings(temperature=0, max_tokens=96, tool_choice="add"),
            tool_use_behavior="stop_on_first_tool",
        )
        first = await Runner.run(caller, "What is 17 + 25?", max_turns=1)
        # the tool's output: the sum, or the SDK's error text when SmolLM2's arguments do not
        # validate (it often writes the numbers as strings); either way it goes back to the model
        kinds = [item.type for item in first.new_items]
        assert "tool_call_item" in kinds and "tool_call_output_item" in kinds, kinds
        output = str(first.final_output)
        answerer = caller.clone(
            model_settings=ModelSettings(temperature=0, max_tokens=48, tool_choice="none"),
            tool_use_behavior="run_llm_again",
        )
        follow_up = [*first.to_input_list(), {"role": "user", "content": "So what is it?"}]
        try:
            await Runner.run(answerer, follow_up, max_turns=1)
            cut = False
        except ModelBehaviorError as e:  # the SDK raises on a Responses reply cut by the cap
            assert api == "responses" and "max_output_tokens" in str(e), e
            cut = True
        traj = await gw.close_session(sid)
        if cut:  # (chat's SDK returns a cut reply as it is: its turn may say `length` too)
            assert traj.turns[-1].finish_reason == "length"
        assert [t.finish_reason for t in traj.turns][0] == "tool_calls"
        records = engine.of_session(sid)
        assert len(records) == 2
        assert_token_in_token_out(records)
        assert check_trajectory(traj, records) == records
        (seg,) = traj.segments
        untrained = [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if not m]
        assert output in gw.renderer.decode(untrained[len(records[0].input_ids) :])
    finally:
        await gw.aclose()
        await engine.close()
