"""Test chat agent: asks with the row's tools and rewards 1 when they arrived (ctx.tools) and the server parsed the
reply's <tool_call> into an OpenAI tool call."""

import json

import openai

from runtime.agents import ChatAgent, ChatAgentRunner, Result


class SeesTools(ChatAgent):
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages, tools=ctx.tools)
        calls = reply.choices[0].message.tool_calls or []
        names = [c.function.name for c in calls]
        args = [json.loads(c.function.arguments) for c in calls]
        ok = bool(ctx.tools) and names == ["python"] and args == [{"code": "print(1)"}]
        return Result(reward=float(ok))


AgentRunner = ChatAgentRunner(SeesTools)
