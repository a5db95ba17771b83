"""Tiny, deterministic Hugging Face checkpoints for the oracle tests.

Everything is built offline in a few seconds: a byte-level BPE tokenizer trained
on an embedded English text, and one random-init model per supported MoE
family, built with ``transformers`` itself so that ``transformers`` can act as
the reference ("oracle") implementation that colibri is compared against.

API::

    FAMILIES: tuple[str, ...]
    VOCAB_SIZE, PAD_ID, BOS_ID, EOS_ID, SPECIAL_TOKENS, CHAT_TEMPLATE, TRAIN_TEXT, PROMPT
    encode(text) -> list[int]                      # with the leading <s>, like AutoTokenizer
    make_tokenizer_files(folder) -> Path
    tiny_config_kwargs(model_type) -> dict[str, Any]
    build_tiny_model(model_type, *, seed=0, **config_overrides) -> PreTrainedModel
    make_tiny_checkpoint(model_type, folder, *, seed=0, fused=False,
                         dtype=torch.float32, **config_overrides) -> Path
    load_hf(folder) -> PreTrainedModel            # eval, float32, eager attention
    hf_logits(model, ids) -> Tensor [T, V]         # one full forward, no cache
    hf_greedy(model, ids, n) -> list[int]          # n new tokens, eos never stops it
    hf_greedy_with_logits(model, ids, n) -> (list[int], Tensor [n, V])
    top2_margins(logits [..., V]) -> Tensor [...]  # top1 - top2 per row

Tensor names on disk
--------------------
``make_tiny_checkpoint(..., fused=False)`` uses ``save_pretrained``, which in
transformers v5 converts the in-memory fused experts back to the *legacy*
per-expert layout that real hub checkpoints have:

- mixtral: ``model.layers.{i}.block_sparse_moe.gate.weight`` and
  ``model.layers.{i}.block_sparse_moe.experts.{e}.w1/w2/w3.weight``
  (w1 = gate [I, H], w3 = up [I, H], w2 = down [H, I]).
- olmoe, qwen3_moe, qwen2_moe, glm4_moe, deepseek_v2, deepseek_v3:
  ``model.layers.{i}.mlp.gate.weight`` and
  ``model.layers.{i}.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``.
- llama4_text: saved fused even by ``save_pretrained``: ``feed_forward.router.weight``,
  ``feed_forward.experts.gate_up_proj`` [E, H, 2I] (gate = [..., :I], up = [..., I:]),
  ``feed_forward.experts.down_proj`` [E, I, H], ``feed_forward.shared_expert.*``; dense layers
  ``feed_forward.gate_proj/up_proj/down_proj``.
- gpt_oss: saved fused even by ``save_pretrained`` (as the real hub
  checkpoints are, minus MXFP4): ``mlp.router.weight/bias``,
  ``mlp.experts.gate_up_proj`` [E, H, 2I] with gate/up *interleaved* along the
  last dim (gate = [..., ::2], up = [..., 1::2]), ``mlp.experts.gate_up_proj_bias``
  [E, 2I] (same interleave), ``mlp.experts.down_proj`` [E, I, H],
  ``mlp.experts.down_proj_bias`` [E, H]; note both are [in, out], not [out, in].

``fused=True`` writes the in-memory v5 ``state_dict()`` verbatim:

- mixtral, olmoe, qwen3_moe, qwen2_moe, glm4_moe, deepseek_v2, deepseek_v3:
  ``model.layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows then up
  rows, i.e. ``F.linear(x, w).chunk(2, -1)``) and
  ``model.layers.{i}.mlp.experts.down_proj`` [E, H, I]; the router stays
  ``model.layers.{i}.mlp.gate.weight`` (mixtral too: its ``block_sparse_moe``
  prefix becomes ``mlp``).
- gpt_oss: identical to its ``save_pretrained`` layout above.

Other family-specific tensors (same in both layouts):

- dense MLP layers ``mlp.{gate,up,down}_proj.weight`` (intermediate_size):
  layer 0 of glm4_moe / deepseek_v2 / deepseek_v3 (first_k_dense_replace=1),
  layer 1 of qwen2_moe (mlp_only_layers=[1]).
- qwen2_moe: ``mlp.shared_expert.{gate,up,down}_proj.weight`` and
  ``mlp.shared_expert_gate.weight`` [1, H]; q/k/v biases.
- glm4_moe / deepseek_v2 / deepseek_v3: ``mlp.shared_experts.{gate,up,down}_proj.weight``
  (width moe_intermediate_size * n_shared_experts).
- glm4_moe / deepseek_v3: ``mlp.gate.e_score_correction_bias`` [E].
- glm4_moe: q/k/v biases (attention_bias=True); ``self_attn.q_norm/k_norm`` [head_dim]
  (use_qk_norm=True), as qwen3_moe; olmoe's q_norm/k_norm span the whole
  projection ([n_heads * head_dim] and [n_kv_heads * head_dim]).
- deepseek_v2 (q_lora_rank=None): ``self_attn.q_proj``; deepseek_v3 (q_lora_rank=24):
  ``self_attn.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``; both
  ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj`` / ``o_proj``.
- gpt_oss: ``self_attn.sinks`` [n_heads]; biases on q/k/v/o; router bias.
- dots1: glm4_moe's layout without attention biases, its q/k norm always on, RoPE over the whole
  head; layer 2 slides over 8 positions (max_window_layers=2).
- ernie4_5_moe: ``mlp.moe_statics.e_score_correction_bias`` [1, E]; layer 0 dense; shared experts as
  glm4_moe's; RoPE on interleaved channel pairs.
- hunyuan_v1_moe: ``mlp.gate.wg.weight`` (the router), ``mlp.shared_mlp.*`` (every layer), per-expert
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (or fused as the others), ``self_attn.query_layernorm`` /
  ``key_layernorm`` [head_dim], applied after RoPE.
- minimax_m2: mixtral's layout plus ``mlp.e_score_correction_bias`` [E] (on the MoE block) and
  olmoe's whole-projection ``self_attn.q_norm/k_norm``; RoPE on 16 of the 32 channels of a head.

Every weight is re-drawn by ``_randomize`` (not left at transformers' init), so
norm weights are not all ones, biases and ``e_score_correction_bias`` are not all
zeros: an engine that forgets to load one of them gives different logits.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from tiny_configs import BOS_ID, EOS_ID, FAMILIES, PAD_ID, VOCAB_SIZE, WEIGHT_STD, tiny_config_kwargs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel

# Special tokens come first so their ids are fixed and small, whatever BPE learns.
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")

# Mistral-style: the template writes the bos text itself, so a caller must
# encode the rendered prompt with add_special_tokens=False (exactly what
# transformers' apply_chat_template does) or the prompt gets two <s>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A prompt the margins below were measured on; oracle tests may share it.
PROMPT = "Once upon a time there was"

# Fixed tokenizer training text. Changing it changes every token id and hence
# every tiny checkpoint, so treat it as frozen.
TRAIN_TEXT = """\
Once upon a time there was a little girl who lived in a small house near the woods.
Every morning she walked to the river to fetch water, and every evening she sat by
the fire and listened to the stories her grandmother told. The old woman knew the
names of all the birds and all the trees, and she said that the wind could speak if
you were quiet enough to hear it.
One day the girl found a small brown dog under the bridge. The dog was cold and
hungry, so she carried it home and gave it bread and milk. From that day on the dog
followed her everywhere: to the river, to the market, and into the forest where the
tall trees grew close together and the light was green and soft.
The weather was warm in the summer and the children played in the fields until the
sun went down. In the winter the snow covered the roofs and the roads, and the people
stayed inside, where it was warm, and made soup and baked bread.
A man came to the village with a cart full of books. He said that anyone who could
read would never be alone, because a book is a friend that waits for you. The girl
asked him to teach her, and he did. She learned the letters, then the words, then
whole sentences, and soon she could read the stories by herself.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
How much wood would a woodchuck chuck if a woodchuck could chuck wood? Numbers such
as 1, 2, 3, 10, 42, 100 and 2024 appear in text too, as do questions, answers, lists
and code like print("hello, world") or x = y + 1.
What is the capital of France? The capital of France is Paris. What is two plus two?
Two plus two is four. Can you tell me a story? Yes, of course: the sun was shining,
the birds were singing, and everyone in the town was happy that morning.
"""

# How the weights are drawn (see _randomize / _calibrate_lm_head). Measured
# with transformers 5.23 / torch 2.13 CPU f32, seed 0, 16 short prompts cut
# from TRAIN_TEXT x 48 greedy steps x 8 families = 6144 steps: median
# top1-top2 gap 4.8, 11 of the 6144 gaps (0.18%) below 1e-2, worst 4e-4; in 118
# of the 128 runs all 48 gaps are >= 1e-2, and a run emits 9-24 distinct
# tokens. From "Once upon a time there was", 40 steps, the smallest gap per
# family is: mixtral 0.011, olmoe 0.022, qwen3_moe 0.19, qwen2_moe 0.19,
# glm4_moe 0.13, deepseek_v2 0.11, deepseek_v3 0.0030, gpt_oss 0.030.
# With transformers' own init (std 0.02, plain lm_head) the logit std is 0.16
# and the median gap 0.02-0.045, i.e. ~100x smaller.
#
# 1-D tensors: norm weights are drawn around 1, biases / sinks /
# e_score_correction_bias around 0, with this std.
VECTOR_STD = 0.2
# lm_head is rescaled so that the logits over TRAIN_TEXT have this std:
# random-init logits are otherwise nearly flat, and greedy decoding would hinge
# on 1e-4-sized differences that summation order alone can flip.
LOGIT_STD = 12.0
# lm_head rows get log-normal norms (exp(N(0, s))): a heavier upper tail
# spreads the top order statistics apart, halving the share of near-ties at a
# cost of some diversity in the greedy text.
LM_HEAD_ROW_LOGSTD = 0.3


@functools.cache
def _tokenizer_json() -> str:
    """Trains the BPE once per process; the result is a pure function of TRAIN_TEXT."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXT.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise AssertionError(f"tokenizer trained to {tok.get_vocab_size()} ids, want {VOCAB_SIZE}")
    # Like Llama/Mistral: plain encode() prepends <s>; the chat template
    # instead writes <s> itself (see CHAT_TEMPLATE).
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tok.to_str()


def make_tokenizer_files(folder: str | Path) -> Path:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")
    return folder


# 1-D tensors that scale rather than shift (Gemma 4's): drawn around 1 as norms are (around 0 they would all but
# switch their layer off)
MULTIPLIERS = ("layer_scalar", "per_expert_scale", "router.scale")
# tables transformers derives from the config and saves (MiniMax's lightning decay): kept as built
DERIVED = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


@torch.no_grad()
def _randomize(model: PreTrainedModel, seed: int) -> None:
    """Re-draws every saved tensor from a private generator.

    transformers' own init leaves norms at 1 and biases / correction biases at
    0, which would let an engine that never loads them pass the oracle.
    Walking the state_dict in sorted order with our own generator also keeps the
    weights independent of transformers' init order across versions.
    """
    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    for name in sorted(state):
        t = state[name]
        if not t.is_floating_point() or name.endswith(DERIVED):
            continue
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        if t.dim() >= 2:
            t.copy_(noise * WEIGHT_STD)
        elif "norm" in name or name.endswith(MULTIPLIERS):
            t.copy_(1.0 + noise * VECTOR_STD)
        else:
            t.copy_(noise * VECTOR_STD)
    head = model.get_output_embeddings().weight
    head.mul_(torch.exp(LM_HEAD_ROW_LOGSTD * torch.randn(head.shape[0], 1, generator=gen)))


@torch.no_grad()
def _calibrate_lm_head(model: PreTrainedModel) -> None:
    # Calibrate on real text so the scale reflects the states greedy decoding sees.
    ids = torch.tensor([encode(TRAIN_TEXT)[:128]])
    logits = model(input_ids=ids, use_cache=False).logits.float()
    model.get_output_embeddings().weight.mul_(LOGIT_STD / logits.std().item())


@functools.cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_str(_tokenizer_json())


def encode(text: str) -> list[int]:
    """Token ids of `text` with the leading <s>, as AutoTokenizer(text) gives."""
    return _tokenizer().encode(text).ids


def build_tiny_model(model_type: str, *, seed: int = 0, **config_overrides: Any) -> PreTrainedModel:
    """The in-memory float32 eager model that make_tiny_checkpoint saves."""
    kwargs = {**tiny_config_kwargs(model_type), **config_overrides}
    if model_type in MULTIMODAL:  # a text model transformers builds only inside its multimodal one
        outer, vision = MULTIMODAL[model_type]
        config = AutoConfig.for_model(outer, text_config=kwargs, vision_config=vision,
                                      tie_word_embeddings=kwargs["tie_word_embeddings"],
                                      **ENCODERS.get(model_type, {}))
        model_type = outer
    else:
        config = AutoConfig.for_model(model_type, **kwargs)
    # from_config runs transformers' own init first; _randomize then overwrites
    # every tensor, so this seed only keeps that first pass reproducible.
    torch.manual_seed(seed)
    cls = _causal_lm(model_type)
    build = cls.from_config if cls is AutoModelForCausalLM else cls._from_config
    model = build(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    _randomize(model, seed)
    _calibrate_lm_head(model)
    return model


def make_tiny_checkpoint(
    model_type: str,
    folder: str | Path,
    *,
    seed: int = 0,
    fused: bool = False,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Builds a tiny `model_type` model and saves it plus the tokenizer in `folder`.

    `dtype` is the on-disk dtype (weights are drawn in f32, then rounded).
    `fused=False` saves with save_pretrained (hub layout, per-expert tensors);
    `fused=True` writes the in-memory v5 state_dict verbatim. The module
    docstring lists the tensor names of both.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(model_type, seed=seed, **config_overrides)
    model.to(dtype)
    model.config.dtype = dtype
    if fused:
        from safetensors.torch import save_file

        # clone(): save_file rejects views and tensors sharing storage.
        tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(folder)
    else:
        model.save_pretrained(folder)
        if model_type in HUB_EXPERTS_XW:  # the hub's fused experts are x @ W ([E, in, out]); transformers saves W
            from safetensors.torch import load_file, save_file

            st = load_file(folder / "model.safetensors")
            st = {k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v
                  for k, v in st.items()}
            save_file(st, str(folder / "model.safetensors"), metadata={"format": "pt"})
    make_tokenizer_files(folder)
    return folder


def quantized_pair(src: Path, dst: Path, name: str, packed: dict[str, torch.Tensor], deq: dict[str, torch.Tensor],
                   quantization_config: dict) -> tuple[Path, Path]:
    """Two copies of the checkpoint folder `src` under `dst`: `name` with the `packed` tensors and the
    `quantization_config` in its config.json (a pre-quantized checkpoint), and "deq" with the float weights
    they stand for; -> (dst / name, dst / "deq")."""
    import shutil

    from safetensors.torch import save_file

    for folder, tensors, qc in ((dst / name, packed, quantization_config), (dst / "deq", deq, None)):
        shutil.copytree(src, folder)
        (folder / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        if qc is not None:
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps(cfg | {"quantization_config": qc}))
    return dst / name, dst / "deq"


def edited_copy(src: Path, dst: Path, drop: tuple[str, ...] = (), **changes: Any) -> Path:
    """A copy of the checkpoint folder `src` at `dst` whose config.json lacks the `drop` keys and has `changes`
    (what a released config says differently from transformers' saved one, or a value to be refused)."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in drop} | changes))
    return dst


def converts_dropping(src: Path, extra, ref: Path, out: Path, ids: list[int], **kw) -> Path:
    """`extra(weights)`: tensors a released checkpoint carries beside its text model (an MTP module, a vision
    tower), made from the folder `src`'s own weights and saved next to them. The conversion of `src` to `out`
    (f32) drops exactly those, lists them in its header, and gives the logits of the container `ref`."""
    from safetensors.torch import load_file, save_file

    import colibri
    from colibri.convert.converter import convert
    from colibri.format.container import Container

    more = extra(load_file(src / "model.safetensors"))
    save_file(more, str(src / "model-extra.safetensors"))
    convert(src, out, "f32", progress=False, **kw)
    with Container(out) as c:
        assert sorted(c.meta["converter"]["dropped"]) == sorted(more)
    with colibri.load(out, ctx_size=64, threads=2) as a, colibri.load(ref, ctx_size=64, threads=2) as b:
        assert torch.equal(a.logits(ids), b.logits(ids))
    return out


def converts_to_its_floats(quantized: Path, deq: Path, work: Path, ids: list[int]) -> torch.Tensor:
    """Both folders of `quantized_pair` converted at f32 give the same logits bit for bit (the reader dequantizes
    to the floats they stand for), and those are transformers' on the floats -> the logits of `ids`."""
    import colibri
    from colibri.convert.converter import convert

    a = convert(quantized, work / f"{quantized.name}.coli", "f32", progress=False)
    b = convert(deq, work / "deq.coli", "f32", progress=False)
    with colibri.load(a) as la, colibri.load(b) as lb:
        got, same = la.logits(ids), lb.logits(ids)
    assert torch.equal(got, same)
    torch.testing.assert_close(got, hf_logits(load_hf(deq), ids), rtol=1e-4, atol=1e-4)
    return got


def load_hf(folder: str | Path) -> PreTrainedModel:
    """The transformers model in eval mode, float32, eager attention (the oracle)."""
    model_type = json.loads((Path(folder) / "config.json").read_text())["model_type"]
    model = _causal_lm(model_type).from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _causal_lm(model_type: str):
    """The causal-LM class of `model_type`: AutoModelForCausalLM, or the class itself where transformers' auto
    mapping does not list it there (Mistral 4's)."""
    import transformers

    return getattr(transformers, _NOT_IN_AUTO[model_type]) if model_type in _NOT_IN_AUTO else AutoModelForCausalLM


_NOT_IN_AUTO = {"mistral4": "Mistral4ForCausalLM", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
                "glm4v_moe": "Glm4vMoeForConditionalGeneration",
                "ernie4_5_vl_moe": "Ernie4_5_VLMoeForConditionalGeneration",
                "qwen3_omni_moe_thinker": "Qwen3OmniMoeThinkerForConditionalGeneration"}
# text model_type -> (the multimodal model_type it is built and saved as, a tiny vision config)
MULTIMODAL = {"qwen3_vl_moe_text": ("qwen3_vl_moe", {"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                                                     "num_heads": 2, "out_hidden_size": 64,
                                                     "deepstack_visual_indexes": [0]}),
              "glm4v_moe_text": ("glm4v_moe", {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                               "out_hidden_size": 64}),
              "ernie4_5_vl_moe_text": ("ernie4_5_vl_moe", {"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                                                           "num_heads": 2}),
              "qwen3_omni_moe_text": ("qwen3_omni_moe_thinker", {"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                                                                 "num_heads": 2, "out_hidden_size": 64,
                                                                 "deepstack_visual_indexes": [0]})}
# the other encoders' tiny configs of a multimodal model that has more than a vision one
ENCODERS = {"qwen3_omni_moe_text": {"audio_config": {"encoder_layers": 1, "d_model": 32, "encoder_attention_heads": 2,
                                                     "encoder_ffn_dim": 64, "output_dim": 64, "num_mel_bins": 16,
                                                     "downsample_hidden_size": 16}}}
# families whose released checkpoints store fused experts transposed from what save_pretrained writes
HUB_EXPERTS_XW = {"qwen3_vl_moe_text"}


@torch.no_grad()
def hf_logits(model: PreTrainedModel, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Logits [T, V] (float32) of one full forward over `ids`, no cache."""
    x = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
    return model(input_ids=x, use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy_with_logits(
    model: PreTrainedModel, ids: list[int] | torch.Tensor, n: int
) -> tuple[list[int], torch.Tensor]:
    """`n` greedy tokens after `ids` and the logits [n, V] each was chosen from.

    A manual argmax loop over the model's own KV cache rather than
    ``generate``: it never stops at eos and applies no logits processors.
    """
    x = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
    cache = _cache(model)
    out: list[int] = []
    steps: list[torch.Tensor] = []
    pos = 0
    for _ in range(n):
        positions = torch.arange(pos, pos + x.shape[1]).unsqueeze(0)
        logits = model(input_ids=x, past_key_values=cache, use_cache=True, position_ids=positions).logits
        last = logits[0, -1].float()
        pos += x.shape[1]
        tok = int(last.argmax())
        out.append(tok)
        steps.append(last)
        x = torch.tensor([[tok]])
    return out, torch.stack(steps) if steps else torch.empty(0, model.config.vocab_size)


def _cache(model: PreTrainedModel):
    """An empty cache of the kind the model takes (MiniMax's: its own class, for the lightning states)."""
    if model.config.model_type == "minimax":
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        return MiniMaxCache()
    return DynamicCache(config=model.config)


def hf_greedy(model: PreTrainedModel, ids: list[int] | torch.Tensor, n: int) -> list[int]:
    """`n` greedy new tokens after `ids` (eos does not stop it)."""
    return hf_greedy_with_logits(model, ids, n)[0]


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """top1 - top2 of each row of `logits` [..., V]: how robust an argmax is."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


__all__ = [
    "BOS_ID",
    "CHAT_TEMPLATE",
    "EOS_ID",
    "FAMILIES",
    "PAD_ID",
    "PROMPT",
    "SPECIAL_TOKENS",
    "TRAIN_TEXT",
    "VOCAB_SIZE",
    "build_tiny_model",
    "encode",
    "hf_greedy",
    "hf_greedy_with_logits",
    "hf_logits",
    "load_hf",
    "make_tiny_checkpoint",
    "make_tokenizer_files",
    "tiny_config_kwargs",
    "top2_margins",
]
