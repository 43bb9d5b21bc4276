"""The hf engine's decode step on a CPU as one lean forward of its own, LoRA adapters included.

At one to eight sequences a decode step of SmolLM2 through transformers and peft spent about two
thirds of its time between kernels: Python dispatch of ~40 modules a layer, peft's wrappers around
each of the seven linear layers, the attention mask built anew, a DynamicCache that concatenates
every layer's keys and values onto a new tensor each step. This module computes the same step
directly from the model's weights (measured in docs/ENGINES.md):

- the query, key and value products as one product on the three weights side by side, the gate and
  up products as one, each on a copy packed for oneDNN where packing is on (``cpu_paths``), and at
  1-8 sequences in bfloat16 on a CPU with AVX-512 BF16 on a copy in the layout of our own kernel
  (``decode_kernels``), which reads the weights about twice as fast as oneDNN there;
- an adapter's products on the same fused inputs: its A matrices side by side, its B matrices block
  by block with the adapter's scaling folded in, rows of each adapter in one product;
- rotary embeddings on queries and keys together, the padding mask once a step, attention as
  ``cpu_paths.decode_attention`` computes it (float32 products);
- keys and values written in place into per-layer buffers with room to grow, so a step copies one
  token's worth of them instead of the whole cache.

It computes what the model computes, in the model's dtype and order of operations (but an adapter's
scaling, folded into its B once; the engine's tests hold it to the stock forward's tokens and logprobs),
for the llama-shaped decoders of ``FAST_DECODE_MODELS`` and plain LoRA adapters on their linear layers;
for any other model or adapter (a LoRA variant such as DoRA, adapted embeddings, a bias in LoRA, ...)
``FastDecoder.build`` or ``FastDecoder.add_adapter`` says why not and the engine keeps transformers' forward.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from services.explorer.serving.engines import decode_kernels

log = logging.getLogger(__name__)

# decoders whose layer is exactly: RMSNorm, q/k/v (optional bias), rotary embedding, attention over all
# earlier tokens, o, residual, RMSNorm, act(gate) * up, down, residual
FAST_DECODE_MODELS = ("llama", "mistral", "qwen2")
_GROWTH = 64  # tokens of room a cache buffer gets beyond what it holds when it is (re)allocated
_EMPTY = torch.empty(0)  # "none" where decode_kernels takes a tensor


def _base(module: nn.Module) -> nn.Module:
    """The model's own module under peft's wrapper (a LoRA layer's base layer, a saved module's
    original), or the module itself."""
    for attr in ("base_layer", "original_module"):
        inner = getattr(module, attr, None)
        if isinstance(inner, nn.Module):
            return inner
    return module


class _Linear:
    """One product ``x @ W.T + b`` on a weight packed for oneDNN (when ``packed``) or as it is, and at
    up to ``kern.rows`` rows on the kernel's copy (``kern``) when it has one."""

    __slots__ = ("weight", "bias", "packed", "out", "kern")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool):
        self.out = weight.shape[0]
        self.bias = bias
        self.packed = packed
        self.kern: decode_kernels.Packed | None = None
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kern is not None and x.shape[0] <= self.kern.rows:
            return self.kern(x)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return nn.functional.linear(x, self.weight, self.bias)

    @classmethod
    def fused(cls, layers: list[nn.Linear], packed: bool, kern=None) -> "_Linear":
        """The product of ``layers`` side by side (packed for oneDNN when ``packed``; also in the layout of
        the kernel module ``kern`` when given)."""
        weight = torch.cat([m.weight.detach() for m in layers]) if len(layers) > 1 else layers[0].weight.detach()
        biases = [m.bias for m in layers]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.out_features) for b, m in zip(biases, layers)])
        if (len(layers) == 1 and packed and hasattr(layers[0], "_kaizen_packed")  # cpu_paths already packed it, as it is now
                and layers[0]._kaizen_of == (layers[0].weight.data_ptr(), layers[0].weight._version)):
            lin = cls.__new__(cls)
            lin.weight, lin.bias, lin.packed, lin.out, lin.kern = layers[0]._kaizen_packed, layers[0].bias, True, layers[0].out_features, None
        else:
            lin = cls(weight, bias, packed)
        if kern is not None:
            lin.kern = decode_kernels.Packed(kern, weight, bias)
        return lin


@dataclass
class _Lora:
    """One adapter on one fused product: ``x @ a.T @ b.T`` is its term (scaling folded into ``b``)."""

    a: torch.Tensor  # (in, sum of ranks): the targets' A matrices, transposed, side by side
    b: torch.Tensor  # (sum of ranks, out): each target's B (transposed, times its scaling) in its own block, zeros elsewhere


@dataclass
class _Layer:
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear


@dataclass
class FastDecoder:
    """The decode-step forward over ``model``'s weights (see the module's docstring)."""

    model: nn.Module
    layers: list[_Layer]
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    intermediate: int
    packed: bool
    extra_bytes: int  # the fused copies' bytes and the kernels' copies
    embed: nn.Module
    norm: nn.Module
    head: _Linear
    acts: list[nn.Module]
    adapters: dict[str, list[dict[str, _Lora]]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # adapter name -> why this path cannot run it
    disabled: str = ""  # why this path runs nothing any more (the base weights changed under it)
    kernel: str = ""  # why the step does not run on decode_kernels ("": it does)
    kernel_steps: int = 0  # steps that ran some of their work on decode_kernels
    _kmod: object = None  # the decode_kernels module when ``kernel`` is ""
    _kattention: bool = False  # attention on it (the heads' shapes within its limits)
    _krope: bool = False  # the rotary embedding and the cache's writes on it (a head dimension a multiple of 32)
    _krms: bool = False  # the norms on it, each with the residual sum before it (a hidden size a multiple of 16)
    _ksilu: bool = False  # SiLU(gate) * up on it (the model's activation SiLU, an intermediate size a multiple of 16)
    _klayers: object = None  # decode_kernels.DecodeLayers: the layers of a step in one call (every product on the kernels)
    _klayers_rows: int = 0  # the most rows that call takes (its products' least)
    _klora: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # adapter -> its terms as DecodeLayers.run takes them
    allocations: int = 0  # key and value buffers (re)allocated
    _weights: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # base weights as built from
    _bufs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer: keys, values with room

    # ------------------------------------------------------------------ building

    @staticmethod
    def unsupported(model: nn.Module, device: torch.device) -> str | None:
        """Why ``model`` cannot take this path (None: it can)."""
        config = model.config
        if device.type != "cpu":
            return f"it is for the CPU; this engine runs on {device}"
        if config.model_type not in FAST_DECODE_MODELS:
            return f"model type {config.model_type!r} is not one of {', '.join(FAST_DECODE_MODELS)}"
        if getattr(config, "mlp_bias", False):
            return "the MLP has biases"
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or (
                getattr(config, "use_sliding_window", config.model_type == "mistral") and getattr(config, "sliding_window", None)):
            return "the model uses sliding-window attention"
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
            return "the model's layout is not a llama-shaped decoder"
        for b in inner.layers:
            for m in (b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj, b.self_attn.o_proj,
                      b.mlp.gate_proj, b.mlp.up_proj, b.mlp.down_proj, model.lm_head):
                if type(_base(m)) is not nn.Linear:
                    return f"its linear layers are {type(_base(m)).__name__}, not plain nn.Linear (a quantized model?)"
        return None

    @classmethod
    def build(cls, model: nn.Module, device: torch.device, packed: bool, fuse_budget: int,
              kernels: bool | None = None) -> tuple["FastDecoder | None", str]:
        """The decoder for ``model`` (packed products when ``packed``; the fused copies only when their
        bytes fit ``fuse_budget``, otherwise each product on its own weight; decode_kernels' copies
        and its step on them when ``kernels`` is not False, the model is in bfloat16, they run here and the
        copies fit what is left of the budget: ``kernels`` True asks for them, their absence is then the reason given
        with None), or None and why not."""
        try:
            why = cls.unsupported(model, device)
        except Exception as e:  # noqa: BLE001 - a layout this path does not know: transformers' forward runs it
            why = f"its layout could not be read ({type(e).__name__}: {e})"
        if why:
            return None, why
        config = model.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        blocks = model.model.layers
        fuse_bytes = sum(
            sum(_base(m).weight.numel() * _base(m).weight.element_size() for m in group)
            for b in blocks for group in ((b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj), (b.mlp.gate_proj, b.mlp.up_proj)))
        fuse = fuse_bytes <= fuse_budget
        kern, kernel_why = cls._kernels(model, kernels, fuse_budget - (fuse_bytes if fuse else 0))
        if kernels and kern is None:
            return None, f"engine.decode_kernels is true, but {kernel_why}"
        layers = []
        try:
            for b in blocks:
                att, mlp = b.self_attn, b.mlp
                qkv = [_base(att.q_proj), _base(att.k_proj), _base(att.v_proj)]
                gu = [_base(mlp.gate_proj), _base(mlp.up_proj)]
                layers.append(_Layer(
                    norm_in=_base(b.input_layernorm).weight.detach(), norm_post=_base(b.post_attention_layernorm).weight.detach(),
                    qkv=_Linear.fused(qkv, packed, kern) if fuse else _Split(qkv, packed),
                    o=_Linear.fused([_base(att.o_proj)], packed, kern),
                    gate_up=_Linear.fused(gu, packed, kern) if fuse else _Split(gu, packed),
                    down=_Linear.fused([_base(mlp.down_proj)], packed, kern),
                ))
            head = _Linear.fused([_base(model.lm_head)], packed, kern)
        except RuntimeError as e:  # oneDNN refused to pack
            return None, f"oneDNN cannot pack the weights ({e})"
        # (the kernels' copies hold every weight, so they fit only where the fused copies do: _Split has none)
        products = [lin for L in layers for lin in (L.qkv, L.o, L.gate_up, L.down)] + [head]
        kernel_bytes = sum(k.nbytes for lin in products if (k := getattr(lin, "kern", None)) is not None)
        kattention = kern is not None and heads // kv_heads <= kern.MAX_GROUP and head_dim % 16 == 0 and head_dim <= kern.MAX_HEAD_DIM
        weights = [m.weight for m in model.modules() if type(m) in (nn.Linear, nn.Embedding)]
        dec = cls(model=model, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   eps=_base(blocks[0].input_layernorm).variance_epsilon, intermediate=config.intermediate_size, packed=packed,
                   extra_bytes=(fuse_bytes if fuse else 0) + kernel_bytes, embed=_base(model.model.embed_tokens),
                   norm=_base(model.model.norm), head=head, acts=[b.mlp.act_fn for b in blocks], kernel=kernel_why,
                   _kmod=kern, _kattention=kattention, _krope=kern is not None and head_dim % 32 == 0,
                   _krms=kern is not None and config.hidden_size % 16 == 0,
                   _ksilu=kern is not None and getattr(config, "hidden_act", None) == "silu" and config.intermediate_size % 16 == 0,
                   _weights=[(w, w.data_ptr(), w._version) for w in weights])
        dec._klayers, dec._klayers_rows = dec._layers_on_kernels()
        return dec, ""

    def _layers_on_kernels(self) -> tuple[object, int]:
        """(decode_kernels.DecodeLayers over this model's layers, the most rows it takes) when every part of
        a layer runs on the kernels (its products each on one packed weight, attention, norms, rotary
        embedding, SiLU), else (None, 0)."""
        if not (self._kmod is not None and self._kattention and self._krope and self._krms and self._ksilu):
            return None, 0
        products = [lin for L in self.layers for lin in (L.qkv, L.o, L.gate_up, L.down)]
        if not all(isinstance(lin, _Linear) and lin.kern is not None for lin in products):
            return None, 0
        kerns = [lin.kern for lin in products]
        klayers = self._kmod.DecodeLayers([k.weight for k in kerns], [k.bias for k in kerns], [k.out for k in kerns],
                                          [k.inputs for k in kerns], [w for L in self.layers for w in (L.norm_in, L.norm_post)],
                                          self.heads, self.intermediate, self.eps)
        return klayers, min(k.rows for k in kerns)

    def kernels_note(self) -> str:
        """What of the step runs on decode_kernels, or why nothing does."""
        if self.kernel:
            return "no, " + self.kernel
        parts = [name for name, on in (("attention", self._kattention), ("norms", self._krms), ("rotary embedding", self._krope),
                                       ("SiLU", self._ksilu)) if on]
        amx = f" ({decode_kernels.AMX_MIN_ROWS}-{decode_kernels.MAX_AMX_ROWS} on AMX)" if decode_kernels.amx() else ""
        return f"products at 1-{decode_kernels.max_rows()} rows{amx}" + "".join(", " + p for p in parts)

    @staticmethod
    def _kernels(model: nn.Module, kernels: bool | None, budget: int):
        """(the decode_kernels module, "") when the step can run on it, else (None, why not)."""
        if kernels is False:
            return None, "engine.decode_kernels is false"
        dtype = model.lm_head.weight.dtype
        if dtype != torch.bfloat16:
            return None, f"the model is in {str(dtype).removeprefix('torch.')}; the kernels are for bfloat16"
        # every product's weight in their layout: outputs padded to 16, inputs to an even number, 2 bytes each
        need = sum(-(-m.weight.shape[0] // 16) * 16 * -(-m.weight.shape[1] // 2) * 2 * 2 for m in model.modules()
                   if type(m) is nn.Linear)
        if need > budget:
            return None, (f"its copy of the weights ({need / 2**20:.0f} MiB) does not fit what is left of the packed "
                          f"copies' budget ({max(budget, 0) / 2**20:.0f} MiB)")
        mod, why = decode_kernels.load()
        return mod, why

    # ------------------------------------------------------------------ adapters

    def add_adapter(self, name: str, peft_model: nn.Module) -> None:
        """Take adapter ``name``'s weights from ``peft_model`` (loaded there, in the engine's dtype), or
        record why this path cannot run it (its rows then go through transformers' forward)."""
        self.adapters.pop(name, None)
        self.refused.pop(name, None)
        self._klora.pop(name, None)
        cfg = getattr(peft_model, "peft_config", {}).get(name)
        why = None
        if cfg is None or getattr(cfg, "peft_type", None) is None or str(getattr(cfg.peft_type, "value", cfg.peft_type)) != "LORA":
            why = "it is not a LoRA adapter"
        elif getattr(cfg, "use_dora", False):
            why = "it uses DoRA"
        elif getattr(cfg, "bias", "none") != "none" or getattr(cfg, "lora_bias", False):
            why = "it trains biases"
        elif getattr(cfg, "modules_to_save", None):
            why = "it saves whole modules"
        elif any(getattr(cfg, k, None) for k in ("trainable_token_indices", "layer_replication", "alora_invocation_tokens",
                                                  "arrow_config")):
            why = "it uses trainable tokens, layer replication, activated LoRA or Arrow"
        else:
            why = self._adapted_elsewhere(name)
        if self._weights and any(w.data_ptr() != ptr or w._version != version for w, ptr, version in self._weights):
            # loading it rewrote the base model's weights (an initialisation such as PiSSA's): every product here is stale
            self.disabled = f"the base model's weights changed when adapter {name} was loaded"
            log.warning("fast decode: off from now on: %s", self.disabled)
        if why:
            self.refused[name] = why
            log.info("fast decode: adapter %s goes through transformers' forward: %s", name, why)
            return
        per_layer = []
        try:
            for b in self.model.model.layers:
                att, mlp = b.self_attn, b.mlp
                per_layer.append({k: lora for k, lora in (
                    ("qkv", _lora([att.q_proj, att.k_proj, att.v_proj], name)),
                    ("o", _lora([att.o_proj], name)),
                    ("gate_up", _lora([mlp.gate_proj, mlp.up_proj], name)),
                    ("down", _lora([mlp.down_proj], name)),
                ) if lora is not None})
        except Exception as e:  # noqa: BLE001 - an adapter of a shape not foreseen: transformers' forward still runs it
            self.refused[name] = f"its weights could not be read ({type(e).__name__}: {e})"
            log.warning("fast decode: adapter %s goes through transformers' forward: %s", name, self.refused[name])
            return
        self.adapters[name] = per_layer

    def _adapted_elsewhere(self, name: str) -> str | None:
        """Why adapter ``name`` is more than plain LoRA on the seven linear layers of each decoder layer
        (None: it is not): a module elsewhere adapted (embeddings, the LM head), a LoRA variant (DoRA,
        KaSA, ...), or weights of its own besides A and B on any module (peft's ``adapter_layer_names``)."""
        blocks = self.model.model.layers
        if len(blocks) != len(self.layers):
            return f"the model has {len(blocks)} layers now, {len(self.layers)} when this path was built"
        covered = set()
        for b in blocks:
            covered.update(id(m) for m in (b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj, b.self_attn.o_proj,
                                           b.mlp.gate_proj, b.mlp.up_proj, b.mlp.down_proj))
        for mod_name, m in self.model.named_modules():
            if name in (getattr(m, "lora_variant", None) or {}):
                return f"it is a LoRA variant ({type(m.lora_variant[name]).__name__}) on {mod_name}"
            for attr in getattr(m, "adapter_layer_names", ()):
                d = getattr(m, attr, None)
                if d is None or name not in d:
                    continue
                if id(m) not in covered:
                    return f"it adapts {mod_name}"
                if attr not in ("lora_A", "lora_B"):
                    return f"it has {attr} on {mod_name}"
        return None

    def remove_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.refused.pop(name, None)
        self._klora.pop(name, None)

    def _kernel_lora(self, name: str) -> list[torch.Tensor]:
        """Adapter ``name``'s terms as DecodeLayers.run takes them: a layer at a time, per product (qkv, o,
        gate_up, down) its A and B (empty tensors where it adapts nothing)."""
        flat = self._klora.get(name)
        if flat is None:
            flat = []
            for per in self.adapters[name]:
                for key in ("qkv", "o", "gate_up", "down"):
                    lora = per.get(key)
                    flat += [lora.a, lora.b] if lora is not None else [_EMPTY, _EMPTY]
            self._klora[name] = flat
        return flat

    def runs(self, adapters: list[str | None]) -> bool:
        """Whether a batch on these adapters (None: the base model) can take this path."""
        return not self.disabled and all(a is None or a in self.adapters for a in adapters)

    # ------------------------------------------------------------------ the step

    def step(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor,
             cache: list[tuple[torch.Tensor, torch.Tensor]], adapters: list[str | None]):
        """One decode step: ``ids`` (B,) the new tokens, ``attn`` (B, T + 1) the padding mask with them,
        ``pos`` (B,) their positions, ``cache`` each layer's keys and values (B, KV, T, D) of the earlier
        tokens. Returns (float32 logits (B, vocab), each layer's keys and values with the new token)."""
        with torch.inference_mode():
            return self._step(ids, attn, pos, cache, adapters)

    def _step(self, ids, attn, pos, cache, adapters):
        B, T = attn.shape[0], attn.shape[1] - 1
        if self._kmod is not None and (B <= decode_kernels.max_rows() or self._kattention or self._krms or self._krope or self._ksilu):
            self.kernel_steps += 1
        H, KV, D, G, I = self.heads, self.kv_heads, self.head_dim, self.heads // self.kv_heads, self.intermediate
        groups = _groups(adapters)
        x = self.embed(ids)  # (B, hidden)
        cos, sin = self.model.model.rotary_emb(x, pos.unsqueeze(-1))  # (B, 1, D) each, in x's dtype
        # rotate_half(q) * sin as roll(q, D/2) * (sin with its first half negated): the same products
        sin = sin * self._signs(D, sin.dtype)
        # the padding mask as scores to add, once for every layer: (B * KV, 1, T + 1)
        if self._kattention:  # the kernel's attention: the positions each row attends to
            keep = attn != 0
        else:
            bias = (torch.zeros(attn.shape, dtype=torch.float32).masked_fill_(attn == 0, float("-inf"))
                    .view(B, 1, 1, T + 1).expand(B, KV, 1, T + 1).reshape(B * KV, 1, T + 1))
        bufs = self._buffers(cache, B, T)
        scale = D ** -0.5
        h = self._rms(x, self.layers[0].norm_in)
        if self._klayers is not None and B <= self._klayers_rows:  # the same layers in one call
            adapted = [(rows, a) for a, rows in groups if a is not None]
            out = self._klayers.run(x, h, cos, sin, keep, T, scale, [kb for kb, _ in bufs], [vb for _, vb in bufs],
                                    [rows if rows is not None else _EMPTY for rows, _ in adapted],
                                    [t for _, a in adapted for t in self._kernel_lora(a)])
            return self.head(self.norm(out[0])).float(), list(zip(out[1::2], out[2::2]))
        out_cache = []
        for li, layer in enumerate(self.layers):
            loras = [(rows, self.adapters[a][li]) for a, rows in groups if a is not None]
            qkv = _apply(layer.qkv, h, loras, "qkv").view(B, H + 2 * KV, D)
            kbuf, vbuf = bufs[li]
            if self._krope:  # the same bfloat16 products and sums in one call, keys and values into the buffers
                q_rot = self._kmod.rope_into_cache(qkv, cos, sin, kbuf, vbuf, H, T)
            else:
                qk = qkv[:, : H + KV]
                qk = qk * cos + qk.roll(D // 2, -1) * sin
                kbuf[:, :, T].copy_(qk[:, H:])
                vbuf[:, :, T].copy_(qkv[:, H + KV :])
                q_rot = qk[:, :H]
            k, v = kbuf[:, :, : T + 1], vbuf[:, :, : T + 1]
            out_cache.append((k, v))
            if self._kattention:  # the same sums in float32 in one call, the cache read in place
                a = self._kmod.attention(q_rot, kbuf, vbuf, keep, scale)
            else:
                # cpu_paths.decode_attention's products: float32, query heads grouped by their key-value head
                # (a float32 copy of the cache kept beside it was no faster at 1-32 sequences: docs/ENGINES.md)
                q = q_rot.reshape(B * KV, G, D).float()
                scores = torch.baddbmm(bias, q, k.float().view(B * KV, T + 1, D).transpose(1, 2), alpha=scale)
                a = torch.bmm(torch.softmax(scores, dim=-1), v.float().view(B * KV, T + 1, D)).view(B, H * D).to(x.dtype)
            x, h = self._add_rms(x, _apply(layer.o, a, loras, "o"), layer.norm_post)
            gu = _apply(layer.gate_up, h, loras, "gate_up")
            act = self._kmod.silu_mul(gu, I) if self._ksilu else self.acts[li](gu[:, :I]) * gu[:, I:]
            if li + 1 < len(self.layers):
                x, h = self._add_rms(x, _apply(layer.down, act, loras, "down"), self.layers[li + 1].norm_in)
            else:
                x = x + _apply(layer.down, act, loras, "down")
        return self.head(self.norm(x)).float(), out_cache

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm of the llama family (float32 inside, the weight applied in x's dtype)."""
        if self._krms:
            return self._kmod.rms_norm(x, weight, self.eps)
        return weight * nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def _add_rms(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual sum ``x + delta`` and its RMSNorm (one call on the kernels)."""
        if self._krms:
            return tuple(self._kmod.add_rms_norm(x, delta, weight, self.eps))
        x = x + delta
        return x, self._rms(x, weight)

    @staticmethod
    @functools.cache
    def _signs(D: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([torch.full((D // 2,), -1.0), torch.ones(D - D // 2)]).to(dtype)

    def _buffers(self, cache, B: int, T: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, key and value buffers (B, KV, >T, D) whose first T positions are ``cache``'s: the
        buffers of the last step when ``cache`` is what it returned (the engine neither admitted nor
        pruned rows since) and they have room, else new ones with ``_GROWTH`` positions to spare."""
        if (len(self._bufs) == len(cache) and cache and self._bufs[0][0].shape[0] == B and self._bufs[0][0].shape[2] > T
                and cache[0][0].data_ptr() == self._bufs[0][0].data_ptr() and cache[0][0].shape[2] == T
                and all(k.data_ptr() == kb.data_ptr() and v.data_ptr() == vb.data_ptr()
                        for (k, v), (kb, vb) in zip(cache, self._bufs))):
            return self._bufs
        self._bufs = []  # the last step's buffers go now, before the new ones are filled
        self.allocations += 1
        cap = T + 1 + _GROWTH
        bufs = []
        for k, v in cache:
            kb = k.new_empty((B, k.shape[1], cap, k.shape[3]))
            vb = v.new_empty((B, v.shape[1], cap, v.shape[3]))
            kb[:, :, :T].copy_(k)
            vb[:, :, :T].copy_(v)
            bufs.append((kb, vb))
        self._bufs = bufs
        return bufs

    def release(self) -> None:
        """Forget the cache buffers (the batch is gone)."""
        self._bufs = []


class _Split:
    """Several products on one input, each on its own weight, their outputs side by side (when the
    fused copy does not fit the memory budget)."""

    __slots__ = ("parts",)

    def __init__(self, layers: list[nn.Linear], packed: bool):
        self.parts = [_Linear.fused([m], packed) for m in layers]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _lora(modules: list[nn.Module], name: str) -> _Lora | None:
    """Adapter ``name`` on the fused product of ``modules`` (peft LoRA layers or plain ones), or None
    when it adapts none of them."""
    parts = []
    for m in modules:
        lora_a = getattr(m, "lora_A", None)
        if lora_a is None or name not in lora_a:
            parts.append((None, _base(m).out_features))
            continue
        scale = m.scaling[name]
        b = m.lora_B[name].weight.detach()
        parts.append((lora_a[name].weight.detach(), (b.float() * scale).to(b.dtype)))
    if all(a is None for a, _ in parts):
        return None
    ranks = [a.shape[0] if a is not None else 0 for a, _ in parts]
    outs = [b.shape[0] if a is not None else b for a, b in parts]
    ref = next(a for a, _ in parts if a is not None)
    a_cat = torch.cat([a for a, _ in parts if a is not None])
    b_full = ref.new_zeros((sum(outs), sum(ranks)))
    row = col = 0
    for (a, b), r, o in zip(parts, ranks, outs):
        if a is not None:
            b_full[row : row + o, col : col + r] = b
        row, col = row + o, col + r
    return _Lora(a=a_cat.T.contiguous(), b=b_full.T.contiguous())


def _apply(lin, x: torch.Tensor, loras, key: str) -> torch.Tensor:
    """``lin(x)`` plus each adapter's term on its rows (``rows`` None: all of them)."""
    y = lin(x)
    for rows, per in loras:
        lora = per.get(key)
        if lora is None:
            continue
        if rows is None:
            y = y + (x @ lora.a) @ lora.b
        else:
            y = y.index_add(0, rows, (x.index_select(0, rows) @ lora.a) @ lora.b)
    return y


def _groups(adapters: list[str | None]) -> list[tuple[str | None, torch.Tensor | None]]:
    """Rows per adapter: [(name, row indices or None for all rows)]."""
    distinct = list(dict.fromkeys(adapters))
    if len(distinct) == 1:
        return [(distinct[0], None)]
    return [(a, torch.tensor([i for i, x in enumerate(adapters) if x == a], dtype=torch.long)) for a in distinct]
