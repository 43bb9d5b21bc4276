"""Agent frameworks against a real Explorer serving the real SmolLM2 (a model that ends its
answers, as frameworks expect), each used the way its own docs show: the answer comes back, the
exchange is recorded, and the grouping ids set the framework's natural way arrive.

- OpenAI Agents SDK: both of its model kinds, the default one (the Responses API) and the chat
  completions one, with a function tool offered; ids through ``ModelSettings.metadata``.
- LangChain (``ChatOpenAI`` with a bound tool, plain and streamed): ids through ``extra_body``.
- pydantic-ai (``Agent`` on ``OpenAIChatModel``): ids through ``extra_headers`` in its model settings.
- smolagents (``OpenAIServerModel``, what its agents call): ids through the client's default headers.
- Node's ``openai`` package (installed with npm on first use; skipped without node or npm).
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.integration

agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents) is a test dependency")


@pytest.fixture
def ex(make_explorer, smollm2_model):
    return make_explorer(f"model.path={smollm2_model}", "engine.max_model_len=2048")


def _recorded(ex, task_id: str) -> list[dict]:
    return ex.http.get("/experiences", params={"task_id": task_id, "limit": 100}).json()["data"]


@pytest.mark.parametrize("kind", ["responses", "chat_completions"])
def test_openai_agents_sdk(ex, kind):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
    from agents import set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace export: nothing leaves the machine

    @function_tool
    def lookup(key: str) -> str:
        """Look a key up."""
        return f"value of {key}"

    client = AsyncOpenAI(base_url=f"{ex.url}/v1", api_key="unused", max_retries=0)
    model_cls = OpenAIResponsesModel if kind == "responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="helper", instructions="Answer briefly.", tools=[lookup],
        model=model_cls(model="default", openai_client=client),
        model_settings=ModelSettings(max_tokens=200, temperature=0.0, metadata={"task_id": f"sdk-{kind}", "run_id": "1"}),
    )
    result = asyncio.run(Runner.run(agent, "What is the value of a?", max_turns=3))
    assert isinstance(result.final_output, str)
    rows = _recorded(ex, f"sdk-{kind}")
    assert rows and all(r["run_id"] == "1" and r["agent"] == "default" for r in rows)
    first = rows[0]
    assert first["messages"][0] == {"role": "system", "content": "Answer briefly."}
    assert first["tools"][0]["function"]["name"] == "lookup"
    prefix = "resp-" if kind == "responses" else "chatcmpl-"
    assert first["completion_id"].startswith(prefix)


def test_langchain(ex):
    """LangChain's ChatOpenAI with a bound tool, plain and streamed; ids through extra_body."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def lookup(key: str) -> str:
        """Look a key up."""
        return f"value of {key}"

    llm = langchain_openai.ChatOpenAI(base_url=f"{ex.url}/v1", api_key="unused", model="default", max_tokens=40,
                                      temperature=0, max_retries=0,
                                      extra_body={"metadata": {"task_id": "langchain", "run_id": "7"}})
    answer = llm.bind_tools([lookup]).invoke("What is the value of a?")
    assert answer.content or answer.tool_calls
    streamed = "".join(c.content for c in llm.stream("Say hello."))
    rows = _recorded(ex, "langchain")
    assert len(rows) == 2 and {r["run_id"] for r in rows} == {"7"}
    assert rows[0]["tools"][0]["function"]["name"] == "lookup"
    assert ex.tokenizer.decode(rows[1]["response_token_ids"], skip_special_tokens=True) == streamed
    assert rows[1]["finish_reason"] in ("stop", "length")


def test_pydantic_ai(ex):
    """pydantic-ai's Agent on its OpenAI chat model; ids through the model settings' extra_headers."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("default", provider=OpenAIProvider(base_url=f"{ex.url}/v1", api_key="unused"))
    agent = Agent(model, instructions="Answer briefly.")
    result = agent.run_sync("Is 17 even or odd?", model_settings={
        "max_tokens": 200, "temperature": 0.0, "extra_headers": {"X-Task-Id": "pydantic-ai", "X-Run-Id": "3"}})
    assert isinstance(result.output, str) and result.output
    rows = _recorded(ex, "pydantic-ai")
    assert len(rows) == 1 and rows[0]["run_id"] == "3" and rows[0]["messages"][0]["role"] == "system"
    assert rows[0]["response"]["content"] == result.output


def test_smolagents(ex):
    """smolagents' OpenAIServerModel (what its agents call); ids through client_kwargs' default_headers."""
    smolagents = pytest.importorskip("smolagents")
    from smolagents.models import ChatMessage, MessageRole

    model = smolagents.OpenAIServerModel(
        model_id="default", api_base=f"{ex.url}/v1", api_key="unused", max_tokens=40, temperature=0,
        client_kwargs={"default_headers": {"X-Task-Id": "smolagents", "X-Run-Id": "1"}, "max_retries": 0})
    out = model.generate([ChatMessage(role=MessageRole.USER, content=[{"type": "text", "text": "Say hello."}])])
    assert out.content
    rows = _recorded(ex, "smolagents")
    assert len(rows) == 1 and rows[0]["response"]["content"] == out.content and rows[0]["run_id"] == "1"


NODE_OPENAI = "7.57.0"
NODE_SCRIPT = r"""
const OpenAI = require(process.argv[2]);
const client = new (OpenAI.OpenAI || OpenAI)({ baseURL: process.argv[3], apiKey: "unused", maxRetries: 0 });
(async () => {
  const meta = { task_id: "node", run_id: "5" };
  const r = await client.chat.completions.create({ model: "default", messages: [{ role: "user", content: "Say hello." }],
                                                   max_tokens: 12, metadata: meta });
  let text = "";
  const stream = await client.chat.completions.create({ model: "default", messages: [{ role: "user", content: "Hi." }],
                                                        max_tokens: 12, stream: true, metadata: meta });
  for await (const chunk of stream) { for (const c of chunk.choices) text += c.delta.content || ""; }
  console.log(JSON.stringify({ plain: r.choices[0].message.content, streamed: text }));
})().catch((e) => { console.error(e); process.exit(1); });
"""


def test_node_openai(ex, tmp_path):
    """The Node `openai` package: chat and streaming, ids in `metadata` as the OpenAI API takes them."""
    import json
    import shutil
    import subprocess

    from tests.helpers import REPO

    node, npm = shutil.which("node"), shutil.which("npm")
    if not (node and npm):
        pytest.skip("node and npm are not installed")
    prefix = REPO / ".cache" / f"node-openai-{NODE_OPENAI}"
    module = prefix / "node_modules" / "openai"
    if not module.is_dir():
        res = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", f"openai@{NODE_OPENAI}"],
                             capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            pytest.skip(f"npm could not install openai@{NODE_OPENAI}: {res.stderr[-500:]}")
    script = tmp_path / "chat.cjs"
    script.write_text(NODE_SCRIPT)
    res = subprocess.run([node, str(script), str(module), f"{ex.url}/v1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    rows = _recorded(ex, "node")
    assert len(rows) == 2 and {r["run_id"] for r in rows} == {"5"}
    assert rows[0]["response"]["content"] == out["plain"]
    assert ex.tokenizer.decode(rows[1]["response_token_ids"], skip_special_tokens=True) == out["streamed"]
