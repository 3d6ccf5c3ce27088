"""Test chat agent: two model calls; the second rewrites the history, so the episode records two segments (two
step-samples of one rollout). Reward 1 when the first reply is the label. A reply "boom" raises (agent_error)."""

import openai

from runtime.agents import ChatAgent, ChatAgentRunner, Result


class TwoSegments(ChatAgent):
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        first = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        text = (first.choices[0].message.content or "").replace("<|im_end|>", "").strip()
        if text == "boom":
            raise RuntimeError("agent failed on purpose")
        await client.chat.completions.create(model=ctx.model_name,
                                             messages=[{"role": "user", "content": "Summary: " + text}])
        return Result(reward=float(text == str(ctx.label)), info={"calls": 2.0})


AgentRunner = ChatAgentRunner(TwoSegments)
