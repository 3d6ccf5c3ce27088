"""Demo chat agent: the demo's addition task written as a `ChatAgent` that talks to the policy through the stock
OpenAI SDK client, as an agent written for a hosted model would.

    .venv/bin/molt-compile recipes/demo_math.yaml --set agent.path=recipes/agents/demo_math_chat.py --submit

The runner's loopback server renders the dataset's messages with the model's chat template, generates on the
rollout engines and records the exact tokens, so the trainer learns from what the engine produced; the agent only
sees text. Rewards as in `demo_math.py`: 1 for the exact sum, 0.1 for a wrong number, 0 otherwise.
"""

import openai

from runtime.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


class AdditionChat(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        # The SDK's 5 s connect timeout is for the internet; on a busy 2-core machine the loopback server can take
        # longer to accept. A retry is safe: the server answers an identical request from its cache.
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, timeout=600.0, max_retries=3)
        reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        answer = (reply.choices[0].message.content or "").replace("<|im_end|>", "").strip()
        correct = answer == str(ctx.label).strip()
        reward = 1.0 if correct else 0.1 if answer.isdigit() else 0.0
        return Result(reward=reward, score=float(correct), info={"answered_number": float(answer.isdigit())})


AgentRunner = ChatAgentRunner(AdditionChat)
