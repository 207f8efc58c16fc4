"""Weights of a supported checkpoint, in the layout the executor wants.

q/k/v projections are fused into one [qkv_width, d] matrix and gate/up into one [2F, d]
matrix, so that each chunk runs two big matmuls instead of five small ones.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import torch

from ..contract.checkpoint import CLASSIFIER_HEAD
from ..contract.errors import ConfigError
from ..kernels.linear import pack, weight_nbytes
from .spec import ModelSpec


# Norm weights are kept in float32 whatever the model dtype: they are tiny, and the norm
# kernel multiplies them into float32 statistics before the single rounding to the dtype.
NORM_DTYPE = torch.float32


_PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")
_BIASES = ("bqkv", "bo", "b_gate_up", "b_down")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [d] float32
    # the four projections' weights are plain [out, in] tensors, or packed for the linear backend
    # (kernels.linear.pack, once at load: ModelWeights.pack_linears)
    wqkv: torch.Tensor  # [q_width + 2*kv_width, d]
    bqkv: torch.Tensor | None  # [q_width + 2*kv_width]
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    wo: torch.Tensor  # [d, q_width]
    bo: torch.Tensor | None
    post_norm: torch.Tensor  # [d] the norm before the MLP (Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm)
    w_gate_up: torch.Tensor  # [2F, d]: rows [0, F) gate, [F, 2F) up
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor  # [d, F]
    b_down: torch.Tensor | None
    attn_out_norm: torch.Tensor | None = None  # [d] Gemma: on attention's output, before the residual add
    mlp_out_norm: torch.Tensor | None = None  # [d] Gemma: on the MLP's output, before the residual add

    def projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of the four projections, in the order a layer runs them."""
        return [(getattr(self, w), getattr(self, b)) for w, b in zip(_PROJECTIONS, _BIASES)]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, d]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [d]
    # [vocab, d]; the same tensor as embed when tied, until pack_linears gives it the linear backend's
    # layout (then its own copy when tied: the embedding lookup reads the plain rows). A checkpoint
    # without an LM head (an embedding model, a classifier) has the embedding here: the forward's
    # last-row logits are then never asked for (the engine refuses token-scoring kinds there)
    lm_head: torch.Tensor
    score: torch.Tensor | None = None  # [labels, d] float32: a sequence classifier's head (spec.head "classifier")

    def nbytes(self) -> int:
        """Bytes of every weight tensor (packed ones as packed), a tied head counted once."""
        tensors = [self.embed, self.final_norm, self.lm_head] + ([self.score] if self.score is not None else [])
        tensors += [t for layer in self.layers for t in vars(layer).values() if t is not None]
        key = lambda t: t.untyped_storage().data_ptr() if t.layout == torch.strided else id(t)  # noqa: E731
        return sum(weight_nbytes(t) for t in {key(t): t for t in tensors}.values())

    def pack_linears(self, backend: str, pack_lm_head: bool = True) -> "ModelWeights":
        """Every layer's projection weights in the layout `backend` reads (kernels.linear.pack),
        in place, one at a time (the plain tensor is dropped once packed), and the LM head likewise
        where `pack_lm_head` (a logprob span runs it on every scored position: oneDNN's packed GEMM
        was 1.2-1.4x aten's on SmolLM2's head at 64-256 rows, perf/RESULTS.md; the float32 score
        heads read the plain rows instead: kernels.score_head); returns self. Weights packed already
        stay so (ValueError where `backend` cannot read them: its gemm never looks at the layout)."""
        for layer in self.layers:
            for name in _PROJECTIONS:
                setattr(layer, name, pack(getattr(layer, name), backend))
        if pack_lm_head:  # onednn: a copy when tied (the embedding keeps the plain rows)
            self.lm_head = pack(self.lm_head, backend)
        return self

    @classmethod
    def load(cls, folder: str, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> "ModelWeights":
        reader = _SafetensorsFolder(folder)

        def get(name: str, required: bool = True, as_dtype: torch.dtype = dtype):
            t = reader.get(name, required)
            return None if t is None else t.to(device=device, dtype=as_dtype)

        def norm(name: str):
            w = get(name, as_dtype=NORM_DTYPE)
            return w + 1.0 if spec.norm_plus_one else w  # Gemma's RMSNorm multiplies by (1 + w), in float32

        def cat(names: list[str], required: bool = True):
            parts = [reader.get(n, required) for n in names]
            if any(p is None for p in parts):
                return None
            return torch.cat(parts).to(device=device, dtype=dtype)

        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            # separate projections, or (Phi-3) already fused in the same [q; k; v] and [gate; up] order
            attn = [p + f"self_attn.{x}_proj" for x in "qkv"] if spec.family != "phi3" else [p + "self_attn.qkv_proj"]
            mlp = [p + "mlp.gate_proj", p + "mlp.up_proj"] if spec.family != "phi3" else [p + "mlp.gate_up_proj"]
            layers.append(
                LayerWeights(
                    input_norm=norm(p + "input_layernorm.weight"),
                    wqkv=cat([n + ".weight" for n in attn]),
                    bqkv=cat([n + ".bias" for n in attn], required=spec.qkv_bias) if spec.qkv_bias else None,
                    q_norm=norm(p + "self_attn.q_norm.weight") if spec.qk_norm else None,
                    k_norm=norm(p + "self_attn.k_norm.weight") if spec.qk_norm else None,
                    wo=get(p + "self_attn.o_proj.weight"),
                    bo=get(p + "self_attn.o_proj.bias") if spec.o_bias else None,
                    post_norm=norm(p + ("pre_feedforward_layernorm" if spec.sandwich_norms else "post_attention_layernorm") + ".weight"),
                    w_gate_up=cat([n + ".weight" for n in mlp]),
                    b_gate_up=cat([n + ".bias" for n in mlp]) if spec.mlp_bias else None,
                    w_down=get(p + "mlp.down_proj.weight"),
                    b_down=get(p + "mlp.down_proj.bias") if spec.mlp_bias else None,
                    attn_out_norm=norm(p + "post_attention_layernorm.weight") if spec.sandwich_norms else None,
                    mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if spec.sandwich_norms else None,
                )
            )
        embed = get("model.embed_tokens.weight")
        lm_head = embed if spec.tie_word_embeddings else get("lm_head.weight", required=False)
        if lm_head is None:  # some tied checkpoints omit the flag but also the tensor
            lm_head = embed
        score = get("score.weight", as_dtype=NORM_DTYPE) if spec.head == CLASSIFIER_HEAD else None
        weights = cls(embed=embed, layers=layers, final_norm=norm("model.norm.weight"), lm_head=lm_head, score=score)
        weights.check_shapes(spec)
        return weights

    @classmethod
    def random(cls, spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int = 0, std: float = 0.02):
        """Random weights of a real shape, made directly on `device` (speed/memory runs, GPU check)."""
        g = torch.Generator(device=device).manual_seed(seed)

        def rnd(*shape):
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

        def ones(n):
            return torch.ones(n, device=device, dtype=NORM_DTYPE)

        d, f, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
        layers = [
            LayerWeights(
                input_norm=ones(d),
                wqkv=rnd(spec.qkv_width, d),
                bqkv=rnd(spec.qkv_width) if spec.qkv_bias else None,
                q_norm=ones(hd) if spec.qk_norm else None,
                k_norm=ones(hd) if spec.qk_norm else None,
                wo=rnd(d, spec.q_width),
                bo=rnd(d) if spec.o_bias else None,
                post_norm=ones(d),
                w_gate_up=rnd(2 * f, d),
                b_gate_up=rnd(2 * f) if spec.mlp_bias else None,
                w_down=rnd(d, f),
                b_down=rnd(d) if spec.mlp_bias else None,
                attn_out_norm=ones(d) if spec.sandwich_norms else None,
                mlp_out_norm=ones(d) if spec.sandwich_norms else None,
            )
            for _ in range(spec.num_layers)
        ]
        embed = rnd(spec.vocab_size, d)
        lm_head = embed if spec.tie_word_embeddings else rnd(spec.vocab_size, d)
        score = rnd(len(spec.labels), d).float() if spec.head == CLASSIFIER_HEAD else None
        return cls(embed=embed, layers=layers, final_norm=ones(d), lm_head=lm_head, score=score)

    def check_shapes(self, spec: ModelSpec) -> None:
        d, f = spec.hidden_size, spec.intermediate_size
        expect = {
            "embed": (self.embed, (spec.vocab_size, d)),
            "lm_head": (self.lm_head, (spec.vocab_size, d)),
            **({"score": (self.score, (len(spec.labels), d))} if self.score is not None else {}),
            "layers.0.wqkv": (self.layers[0].wqkv, (spec.qkv_width, d)),
            "layers.0.wo": (self.layers[0].wo, (d, spec.q_width)),
            "layers.0.w_gate_up": (self.layers[0].w_gate_up, (2 * f, d)),
            "layers.0.w_down": (self.layers[0].w_down, (d, f)),
        }
        for name, (t, shape) in expect.items():
            if tuple(t.shape) != shape:
                raise ConfigError(f"weight {name} has shape {tuple(t.shape)}, config implies {shape}")


class _SafetensorsFolder:
    """Reads tensors by name from one or many *.safetensors files of a folder."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            files = [os.path.join(folder, x) for x in files]
        else:
            files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise ConfigError(f"model folder {folder!r} has no *.safetensors files")
        self._where = {}
        self._handles = []
        for path in files:
            h = safe_open(path, framework="pt")
            self._handles.append(h)
            for name in h.keys():
                self._where[name] = h

    def get(self, name: str, required: bool = True):
        h = self._where.get(name)
        if h is None and name.startswith("model.") and name[6:] in self._where:
            name = name[6:]  # a bare model saved on its own (an embedding model): no "model." prefix
            h = self._where[name]
        if h is None:
            if required:
                raise ConfigError(f"checkpoint is missing tensor {name!r}")
            return None
        return h.get_tensor(name)
