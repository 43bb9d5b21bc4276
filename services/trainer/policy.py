"""The policy being trained: one base model, one LoRA adapter (and value head) per agent.

Agents share the frozen base weights (MARFT's multi-adapter setup); each has its own adapter, so
the memory cost of an agent is its adapter and optimizer state. The reference policy for the KL
term is the base model with the adapter disabled, not a second copy.

Batches are laid out with prompts left-padded to a common length P and responses right-padded to
R, so the final hidden state that scores response token t sits at column P - 1 + t for every row.
The LM head runs on those of the real response tokens alone, packed (no padding, no prompt), when
the model's logits are its head's product (``head_is_last``); else on the model's own logits there.

A prefix every row shares (an agent's system prompt with its tool descriptions is often most of a
prompt) is computed once: one forward over it builds its keys and values, which are expanded to
every row (a view), and the rows' own tokens attend to them. Gradients flow back through the
expansion into that one computation, so losses and gradients are those of the plain layout (up to
float rounding), for a fraction of the work.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from services.common import grammar as grammars
from services.common.models import load_base_model, resolve_device, resolve_dtype, shared_prefix_len, stop_token_ids
from services.trainer import attention as grouped_eager
from services.trainer import train_kernels
from services.trainer.lora_products import fuse_lora_layers
from services.trainer.token_stats import token_stats

log = logging.getLogger(__name__)

# config fields (of the model's config or its text config) of models whose forward changes the logits after
# the LM head: Gemma 2/3n soft-capping, RecurrentGemma's, Cohere's and Granite's scaling, Falcon-H1's multiplier ...
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logits_soft_cap", "logit_scale", "logits_scaling",
                     "lm_head_multiplier", "output_multiplier", "unpadded_vocab_size")


def head_is_last(model: nn.Module) -> bool:
    """Whether ``model``'s logits are its LM head applied to its decoder's last hidden state, nothing
    after: no known logit transform in its config, and the two agree on a few tokens. A model that does
    something else there, or has no such parts, is scored through its own forward (``logits_to_keep``)
    with one row per call (``pack(chain=False)``). The check feeds token ids alone, so a model whose
    config is made of several (a vision-language model's text and vision parts, whose forward builds
    other inputs for its decoder: image features, multimodal positions) is refused by its config."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        log.info("calls are not chained for this model: its config %s is made of several", type(config).__name__)
        return False
    if any(getattr(config, k, None) for k in _LOGIT_TRANSFORMS):
        return False
    try:
        ids = torch.arange(1, 9, device=model.device).unsqueeze(0) % int(text.vocab_size)
        with torch.no_grad():
            whole = model(input_ids=ids, use_cache=False).logits.float()
            parts = model.get_output_embeddings()(model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state).float()
    except Exception as e:  # noqa: BLE001 - any model without these parts simply does not chain
        log.info("calls are not chained for this model: %s", e)
        return False
    # the same operations either way; the tolerance allows a kernel's bfloat16 rounding, not a transform
    return parts.shape == whole.shape and torch.allclose(parts, whole, rtol=1e-2, atol=1e-2 * max(1.0, float(whole.abs().max())))


class ValueHead(nn.Module):
    """The critic: a small MLP on the policy's final hidden states (detached)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.Tanh(), nn.Linear(hidden_size, 1))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, T, H) -> (B, T)
        return self.net(hidden.float()).squeeze(-1)


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (B, P + R): each row's prompt after the shared prefix, then its response
    attention_mask: torch.Tensor  # (B, P + R)
    position_ids: torch.Tensor  # (B, P + R), counted from the start of the shared prefix
    response_ids: torch.Tensor  # (B, R)
    response_mask: torch.Tensor  # (B, R) float
    temperatures: torch.Tensor  # (B,)
    prompt_len: int  # P (after the shared prefix)
    response_len: int  # R
    prefix_ids: torch.Tensor | None = None  # (L,): the prompt tokens every row starts with, computed once
    # Calls computed inside another's row (``pack(chain=True)``): the model's body runs the rows below, and
    # each call's response positions are picked from its final hidden states before the LM head.
    # response_ids, response_mask, temperatures and response_len above stay the calls'; input_ids,
    # attention_mask, position_ids and prompt_len the rows'.
    chain: "Chain | None" = None

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix_ids is None else int(self.prefix_ids.numel())


@dataclass
class Chain:
    response_ids: torch.Tensor  # (N, R'): each row's tokens after its prompt (its calls' responses, and what lies between)
    response_len: int  # R'
    index: torch.Tensor  # (B, R) long: where each call's response position sits in the rows' (N * R') positions


def chain_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], temperatures: Sequence[float]
               ) -> list[list[int]]:
    """Calls that one forward can score together: a call whose prompt and response, token for token,
    begin another call's (an episode's first call inside its next one, whose prompt holds the first
    call, its response and the tool's result), at the same temperature. A causal model gives a call's
    response the same logprobs inside the longer sequence as alone (what lies between, a tool's result,
    costs the body's forward over it, which the later call's own row would run anyway). A row's calls
    score at most as many response tokens as the row is long, so the row's length prices its LM head
    too (micro-batches count rows x length): an episode's calls, each a span of its own, fit; copies of
    one call (a group's identical samples) fill a row up to that and then begin another (so may the
    calls of an identical copy of a whole episode: more rows, the same result).
    Rows of call indices, the longest call first; every call in exactly one row; the rows in order of
    their longest call's index."""
    order = sorted(range(len(prompts)), key=lambda i: (-(len(prompts[i]) + len(responses[i])), i))
    rows: list[tuple[list[int], list[int], list[int]]] = []  # (the longest call's tokens, the calls, [tokens scored])
    for i in order:
        full = list(prompts[i]) + list(responses[i])
        for tokens, calls, scored in rows:
            if (temperatures[calls[0]] == temperatures[i] and scored[0] + len(responses[i]) <= len(tokens)
                    and tokens[: len(full)] == full):
                calls.append(i)
                scored[0] += len(responses[i])
                break
        else:
            rows.append((full, [i], [len(responses[i])]))
    return sorted((calls for _, calls, _ in rows), key=lambda calls: calls[0])


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], temperatures: Sequence[float], pad_id: int,
         *, share_prefix_min: int = 0, chain: bool = False) -> PackedBatch:
    """The layout above. With ``share_prefix_min`` > 0 and at least two rows, a common prefix of at
    least that many tokens is split off into ``prefix_ids`` (the rest is laid out as before). With
    ``chain``, calls that ``chain_rows`` finds inside another's sequence are computed in its row."""
    if chain:
        rows = chain_rows(prompts, responses, temperatures)
        if len(rows) < len(prompts):
            return _pack_chained(prompts, responses, temperatures, pad_id, rows, share_prefix_min)
    B = len(prompts)
    L = shared_prefix_len(prompts) if share_prefix_min > 0 and B > 1 else 0
    if L < max(share_prefix_min, 1):
        L = 0
    prefix = torch.tensor(list(prompts[0][:L]), dtype=torch.long) if L else None
    prompts = [p[L:] for p in prompts]
    P = max(len(p) for p in prompts)
    R = max(len(r) for r in responses)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    resp = torch.full((B, R), pad_id, dtype=torch.long)
    rmask = torch.zeros((B, R))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
        attn[i, P - len(p) : P + len(r)] = 1
        resp[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        rmask[i, : len(r)] = 1.0
    pos = L + (attn.cumsum(-1) - 1).clamp(min=0)
    return PackedBatch(ids, attn, pos, resp, rmask, torch.tensor(list(temperatures), dtype=torch.float32), P, R, prefix)


def _pack_chained(prompts, responses, temperatures, pad_id: int, rows: list[list[int]], share_prefix_min: int) -> PackedBatch:
    """Each row from its shortest prompt to the end of its longest call; the calls' own fields beside."""
    starts = [min(len(prompts[i]) for i in calls) for calls in rows]
    fulls = [list(prompts[calls[0]]) + list(responses[calls[0]]) for calls in rows]
    model = pack([f[:s] for f, s in zip(fulls, starts)], [f[s:] for f, s in zip(fulls, starts)],
                 [temperatures[calls[0]] for calls in rows], pad_id, share_prefix_min=share_prefix_min)
    B, R, width = len(prompts), max(len(r) for r in responses), model.response_len
    resp = torch.full((B, R), pad_id, dtype=torch.long)
    rmask = torch.zeros((B, R))
    index = torch.zeros((B, R), dtype=torch.long)
    for n, (calls, start) in enumerate(zip(rows, starts)):
        for i in calls:
            k = len(responses[i])
            resp[i, :k] = torch.tensor(list(responses[i]), dtype=torch.long)
            rmask[i, :k] = 1.0
            offset = n * width + len(prompts[i]) - start
            index[i, :k] = torch.arange(offset, offset + k)
    chain = Chain(response_ids=model.response_ids, response_len=width, index=index)
    return replace(model, response_ids=resp, response_mask=rmask, response_len=R,
                   temperatures=torch.tensor(list(temperatures), dtype=torch.float32), chain=chain)


@dataclass
class ForwardOut:
    logprobs: torch.Tensor  # (B, R) of the response tokens, at each row's temperature
    entropy: torch.Tensor  # (B, R), with grad only when asked for (entropy bonus)
    hidden: torch.Tensor | None  # (B, R, H): the state before each response token (for the critic)
    gathered: torch.Tensor | None = None  # (B, R, k): logprobs of the ``gather`` ids at each position
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, R, k) logprobs and ids of the k likeliest tokens


class Policy:
    def __init__(self, *, model_path: str, dtype: str, device: str, lora, seed: int = 0, chat_template: str | None = None,
                 attention: str = "auto"):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model_path = model_path
        # The tokenizer renders prompts exactly as the Explorer does (same chat template).
        self.tokenizer, base = load_base_model(model_path, dtype=self.dtype, device=self.device, chat_template=chat_template)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        base.config.use_cache = False
        self._cpu_bf16 = self.device.type == "cpu" and self.dtype == torch.bfloat16
        self.attention = set_attention(base, resolve_attention(attention, self.dtype, self.device), strict=attention != "auto")
        # auto's plain products only for forwards whose attention scores are small (_pick_attention)
        self._auto_eager = attention == "auto" and self.attention == "eager"
        if self.attention == "eager":  # transformers' eager arithmetic on the grouped layout (services/trainer/attention.py)
            base.config._attn_implementation = grouped_eager.register()
        # llama-form RMSNorms in one pass each way on a CPU in bfloat16 (services/trainer/train_kernels.py)
        self.fused_norms, why = train_kernels.fuse_norms(base) if self._cpu_bf16 else (0, "")
        if why:
            log.info("trainer: RMSNorm stays on torch's ops (%s)", why)
        self.base = base
        self.lora = lora
        self.seed = seed
        self.model = None  # PeftModel, once the first agent exists
        self.value_heads: dict[str, ValueHead] = {}
        self.active: str | None = None
        self._grammar_cache: grammars.GrammarCache | None = None
        # Weights in bfloat16 (or float16) with LoRA in float32 (peft keeps adapters in float32, so the
        # optimizer updates float32 weights): the LoRA products run in the weights' dtype under autocast,
        # their float32 weights cast once per forward (they are small), rather than peft casting every
        # activation up to float32 and each sum back down, three copies per adapted layer per pass.
        # Measured and tested on CPU only (on CUDA autocast would also move softmax and norms to float32).
        self.mixed = self.dtype in (torch.bfloat16, torch.float16) and self.device.type == "cpu"
        # forward applies the LM head to the response tokens' final hidden states itself (chained batches too):
        # only for models whose logits are that product alone (no soft-capping or scaling after the head)
        self.chains = head_is_last(base)

    # ------------------------------------------------------------------ adapters

    def _lora_config(self):
        from peft import LoraConfig

        return LoraConfig(
            r=self.lora.r, lora_alpha=self.lora.alpha, lora_dropout=self.lora.dropout,
            target_modules=list(self.lora.target_modules), bias="none", task_type="CAUSAL_LM",
        )

    def has_agent(self, agent: str) -> bool:
        return self.model is not None and agent in self.model.peft_config

    def add_agent(self, agent: str, *, critic: bool) -> None:
        """A fresh adapter (LoRA B = 0: the agent starts exactly at the base model)."""
        from peft import get_peft_model

        torch.manual_seed(self.seed)
        if self.model is None:
            self.model = get_peft_model(self.base, self._lora_config(), adapter_name=agent)
        else:
            self.model.add_adapter(agent, self._lora_config())
        if self.mixed:
            from peft.tuners.tuners_utils import BaseTunerLayer

            for module in self.model.modules():
                if isinstance(module, BaseTunerLayer):
                    module.cast_input_dtype_enabled = False  # autocast does it (_compute)
        if self.device.type == "cpu":
            fuse_lora_layers(self.model)  # the adapted layers' products in place of peft's separate passes
        if critic:
            self.value_heads[agent] = ValueHead(self.base.config.hidden_size).to(self.device)
        self.activate(agent)

    def reset_adapter(self, agent: str) -> None:
        """Re-initialise ``agent``'s LoRA weights as ``add_agent`` does (B = 0: exactly the base model)."""
        from peft.tuners.lora import LoraLayer

        torch.manual_seed(self.seed)
        for module in self.model.modules():
            if isinstance(module, LoraLayer) and agent in module.lora_A:
                module.reset_lora_parameters(agent, True)

    def activate(self, agent: str) -> None:
        if self.active != agent:
            self.model.set_adapter(agent)  # also makes only this adapter trainable
            self.active = agent
        self.model.train()

    def adapter_parameters(self, agent: str) -> list[nn.Parameter]:
        return list(self.adapter_named_parameters(agent).values())

    def adapter_named_parameters(self, agent: str) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if f".{agent}." in n and "lora_" in n}

    def adapter_state(self, agent: str) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(self.model, adapter_name=agent).items()}

    def load_adapter_state(self, agent: str, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, {k: v.to(self.device) for k, v in state.items()}, adapter_name=agent)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"adapter state for {agent} has unexpected keys, e.g. {unexpected[:3]}")

    def load_adapter_dir(self, agent: str, path: Path) -> None:
        """Initialise an agent from a published PEFT adapter directory (e.g. a warm start)."""
        from safetensors.torch import load_file

        cfg = json.loads((path / "adapter_config.json").read_text())
        if int(cfg.get("r", -1)) != self.lora.r:
            raise ValueError(f"{path} has LoRA rank {cfg.get('r')}, the trainer is configured for lora.r={self.lora.r}")
        self.load_adapter_state(agent, load_file(str(path / "adapter_model.safetensors")))

    def save_adapter(self, agent: str, out: Path) -> None:
        """Write a flat PEFT adapter dir (adapter_config.json + adapter_model.safetensors)."""
        from safetensors.torch import save_file

        cfg = self.model.peft_config[agent]
        cfg.base_model_name_or_path = self.model_path
        cfg.save_pretrained(str(out))
        save_file(self.adapter_state(agent), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})

    # ------------------------------------------------------------------ forward passes

    def _compute(self):
        """The context the model runs in: autocast to the weights' dtype when LoRA is float32 beside them."""
        return torch.autocast(self.device.type, dtype=self.dtype) if self.mixed else contextlib.nullcontext()

    @property
    def _net(self) -> nn.Module:
        return self.base if self.model is None else self.model

    def _inputs(self, batch: PackedBatch) -> dict:
        """The model's inputs for ``batch``; its shared prefix (if any) is run here, once, and joins
        every row as past keys and values."""
        dev = self.device
        ids, attn = batch.input_ids.to(dev), batch.attention_mask.to(dev)
        inputs = dict(input_ids=ids, attention_mask=attn, position_ids=batch.position_ids.to(dev), use_cache=False)
        (B, T), L = ids.shape, batch.prefix_len
        if batch.prefix_ids is None:
            self._pick_attention(B, T, T)
            return inputs
        from transformers import DynamicCache

        self._pick_attention(1, L, L)
        # the body alone: its keys and values are all the rows need (the LM head on even one position cost 70-150 ms a
        # forward in bfloat16 on a CPU: a one-row product that copied the head's transposed 49,152 x 576 weight first)
        pre = self._net.get_decoder()(input_ids=batch.prefix_ids.to(dev).unsqueeze(0), use_cache=True).past_key_values
        self._pick_attention(B, T, L + T)
        layers = [(k.expand(B, *k.shape[1:]), v.expand(B, *v.shape[1:])) for k, v, *_ in pre]
        inputs.update(attention_mask=torch.cat([attn.new_ones((B, L)), attn], dim=1),
                      past_key_values=DynamicCache(ddp_cache_data=layers), use_cache=True)
        return inputs

    def _pick_attention(self, rows: int, queries: int, keys: int) -> None:
        """trainer.attention auto: plain products for the next forward when its attention scores (rows x
        heads x queries x keys, each layer's kept for the backward in float32 and bfloat16) stay within
        EAGER_MAX_SCORES, else SDPA, whose fused kernel keeps none. The model reads the choice from its
        config at every forward (its attention and its mask's form), so switching costs nothing."""
        if self._auto_eager:
            heads = self.base.config.num_attention_heads
            small = rows * heads * queries * keys <= EAGER_MAX_SCORES
            self.base.config._attn_implementation = grouped_eager.NAME if small else "sdpa"

    def allowed_tokens(self, grammars_of_rows: Sequence[str | None], responses: Sequence[Sequence[int]],
                       response_len: int) -> torch.Tensor | None:
        """(B, R, V) bool: the tokens each row's grammar allowed before each response token, the
        masks the engine sampled under (services/common/grammar.py); None when no row has one."""
        if not any(grammars_of_rows):
            return None
        vocab = self.base.config.vocab_size
        if self._grammar_cache is None:
            self._grammar_cache = grammars.GrammarCache(self.tokenizer, vocab, stop_token_ids=stop_token_ids(self.tokenizer, self.base))
        allowed = torch.ones((len(responses), response_len, vocab), dtype=torch.bool)
        for row, (g, r) in enumerate(zip(grammars_of_rows, responses)):
            if g:
                allowed[row, : len(r)] = grammars.allowed(self._grammar_cache, g, list(r), vocab)
        return allowed

    def forward(self, batch: PackedBatch, *, need_hidden: bool, adapter: bool = True, entropy_grad: bool = False,
                allowed: torch.Tensor | None = None, gather: torch.Tensor | None = None, top_k: int = 0) -> ForwardOut:
        """Logprobs of the response tokens (with grad unless under no_grad), entropy, hidden states.
        ``allowed`` (B, R, V): score each token over the tokens its grammar allowed, as sampled.
        ``gather`` (B, R, k) token ids: their logprobs at each response position too (``gathered``);
        ``top_k``: the k likeliest tokens at each response position (``top``), e.g. a teacher's."""
        P, chain = batch.prompt_len, batch.chain
        if chain is not None and not self.chains:
            raise ValueError(f"{self.model_path}: its logits are not the LM head's product alone: pack its batches without chain")
        net = self._net  # the base model alone until an agent exists (a teacher model has none)
        with contextlib.nullcontext() if adapter or self.model is None else self.model.disable_adapter(), self._compute():
            if not self.chains:  # the model's own logits: its forward changes them after the head
                out = net(**self._inputs(batch), output_hidden_states=need_hidden,
                          logits_to_keep=batch.response_len + 1)  # positions P-1 .. P+R-1; the last one predicts nothing we need
                hidden = out.hidden_states[-1][:, P - 1 : P - 1 + batch.response_len, :] if need_hidden else None
            else:  # the body; the final hidden state before each response token; the LM head on those alone
                body = net.get_decoder()(**self._inputs(batch)).last_hidden_state
                if chain is None:
                    hidden = body[:, P - 1 : P - 1 + batch.response_len, :]
                else:  # each call's positions picked from its row's
                    rows = body[:, P - 1 : P - 1 + chain.response_len, :]
                    hidden = rows.reshape(-1, rows.shape[-1])[chain.index.to(rows.device)]  # (B, R, H): the calls' layout
                heads = _packed_heads(net.get_output_embeddings(), hidden, batch)
        grad = entropy_grad and torch.is_grad_enabled()
        if self.chains:
            return replace(_scatter_stats(heads, batch, allowed, gather, top_k, grad), hidden=hidden if need_hidden else None)
        # each statistic chunk by chunk from the logits' first R positions (services/trainer/token_stats.py): no
        # (B, R, V) float32 copy per statistic is kept for the backward pass
        stats = token_stats(out.logits, batch.temperatures, batch.response_ids, allowed=allowed, gather=gather, top_k=top_k,
                            entropy_grad=grad)
        return ForwardOut(logprobs=stats.logprobs, entropy=stats.entropy, hidden=hidden, gathered=stats.gathered, top=stats.top)


# trainer.attention auto: a forward runs on plain products while its attention scores (rows x heads x queries x
# keys) stay within this many: 8 Mi, 48 MiB a layer kept for the backward. The demo's micro-batches hold about 2 Mi
# (8 rows x 9 heads x ~100 queries x ~280 keys); longer rows, where eager's memory would grow with their square, run
# on SDPA's fused kernel
EAGER_MAX_SCORES = 1 << 23


def resolve_attention(attention: str, dtype: torch.dtype, device: torch.device) -> str:
    """trainer.attention's ``auto``: plain products (eager) for bfloat16 weights on a CPU, where torch's
    fused CPU kernel (SDPA's flash attention) was the slower one, its backward most of all; else SDPA."""
    if attention != "auto":
        return attention
    return "eager" if device.type == "cpu" and dtype == torch.bfloat16 else "sdpa"


def set_attention(model: nn.Module, attention: str, *, strict: bool) -> str:
    """Switch ``model`` to ``attention`` (sdpa or eager); returns the one it runs. Not ``strict`` (auto's
    choice), a model transformers loaded on eager (no SDPA path, or its config asks for eager) keeps it;
    ``strict`` (the setting named one), a model that cannot run it is an error."""
    current = getattr(model.config, "_attn_implementation", None)
    if attention == current or (not strict and attention == "sdpa" and current == "eager"):
        return current
    try:
        model.set_attn_implementation(attention)
    except (ValueError, ImportError) as e:
        if not strict:
            return current
        raise ValueError(f"trainer.attention {attention!r}: this model cannot use it ({e})") from e
    now = model.config._attn_implementation
    if strict and now != attention:
        raise ValueError(f"trainer.attention {attention!r}: this model stays on {now!r}")
    return now


def _packed_heads(head: nn.Module, hidden: torch.Tensor, batch: PackedBatch) -> list:
    """The LM head on the response tokens alone (``hidden`` (B, R, H), before each), packed without
    padding, one group per sampling temperature: [(temperature, flat (B x R) positions, (1, n, V) logits)]."""
    real = batch.response_mask.to(hidden.device).reshape(-1).nonzero().squeeze(-1)
    temps = batch.temperatures.to(hidden.device).unsqueeze(-1).expand(batch.response_ids.shape).reshape(-1)[real]
    groups = [(t, real[temps == t]) for t in temps.unique().tolist()] or [(1.0, real)]  # (no token: one empty group)
    flat = hidden.reshape(-1, hidden.shape[-1])
    return [(t, at, head(flat[at]).unsqueeze(0)) for t, at in groups]


def _scatter_stats(heads, batch: PackedBatch, allowed, gather, top_k: int, entropy_grad: bool) -> ForwardOut:
    """``token_stats`` of the packed logits (``_packed_heads``), laid out (B, R) as the batch's (the
    calls') response fields; 0 at padding."""
    B, R = batch.response_ids.shape
    dev = heads[0][2].device

    def flat(x: torch.Tensor | None) -> torch.Tensor | None:  # (B, R, ...) -> (B x R, ...)
        return None if x is None else x.to(dev).reshape(B * R, *x.shape[2:])

    def put(into: torch.Tensor | None, at: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return into
        base = torch.zeros((B * R, *values.shape[2:]), device=dev, dtype=values.dtype) if into is None else into
        return base.index_copy(0, at, values[0])  # out of place: gradients reach values

    targets, allowed, gather = flat(batch.response_ids), flat(allowed), flat(gather)
    out: dict[str, torch.Tensor | None] = dict.fromkeys(("logprobs", "entropy", "gathered", "top_lp", "top_ids"))
    for temperature, at, logits in heads:
        st = token_stats(logits, torch.tensor([temperature]), targets[at].unsqueeze(0),
                         allowed=None if allowed is None else allowed[at].unsqueeze(0),
                         gather=None if gather is None else gather[at].unsqueeze(0), top_k=top_k, entropy_grad=entropy_grad)
        for name, values in (("logprobs", st.logprobs), ("entropy", st.entropy), ("gathered", st.gathered),
                             ("top_lp", st.top and st.top[0]), ("top_ids", st.top and st.top[1])):
            out[name] = put(out[name], at, values)
    shaped = {k: None if v is None else v.view(B, R, *v.shape[1:]) for k, v in out.items()}
    top = None if shaped["top_lp"] is None else (shaped["top_lp"], shaped["top_ids"])
    return ForwardOut(logprobs=shaped["logprobs"], entropy=shaped["entropy"], hidden=None, gathered=shaped["gathered"], top=top)
