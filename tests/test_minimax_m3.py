"""MiniMax-M3's text model (`minimax_m3_vl_text`). The oracle, batch, tier, prompt-cache and kernel-accuracy tests run
it with every family (tests/tiny_configs.py: zero-centred norms, partial RoPE, a dense layer and two sparse-attention
layers whose indexer selects past 12 positions, the clamped SwiGLU, the biased router beside a shared expert). Here:
variants against transformers' logits and greedy tokens, transformers' own f32 error on this model, the released
config's legacy fields, the release's partial RoPE, when the sparse layers take the kernels, the release's names and
layout, refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_tiny import hf_logits, load_hf, tiny_config_kwargs
from oracle_check import matches_transformers
from safetensors.torch import load_file, save_file

import colibri
from colibri.convert.converter import convert
from colibri.engine import native_step
from colibri.engine.decode_plan import DecodePlan
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.models import minimax_m3_vl_text as m3
from colibri.models.base import build

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
BOUND = 3e-4  # (tests/test_oracle.py BOUNDS: transformers' own f32 error on this model is as large)


@pytest.mark.parametrize("over", [
    # blocks of 3 (the last one partial), 3 kept, two local blocks always kept
    {"index_block_size": 3, "index_topk_blocks": 3, "index_local_blocks": 2},
    # no local block; every layer sparse and routed
    {"index_local_blocks": 0, "layer_types": ["minimax_m3_sparse"] * 3, "mlp_layer_types": ["sparse"] * 3},
])
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    matches_transformers(ckpt, "minimax_m3_vl_text", over, PROMPT, bound=BOUND)


def test_transformers_own_f32_error_is_the_bound(ckpt) -> None:
    """The oracle's bound for this family: transformers' f32 logits against its own f64 ones are as far as ours."""
    hf = load_hf(ckpt.hf("minimax_m3_vl_text"))
    ids = PROMPT * 3
    f32 = hf_logits(hf, ids).double()
    hf = hf.double()
    hf.set_experts_implementation("eager")  # (the grouped kernels take no f64)
    with torch.no_grad():
        f64 = hf(torch.tensor([ids])).logits[0]
    with colibri.load(ckpt.coli("minimax_m3_vl_text", "f32"), ctx_size=64, threads=2) as llm:
        ours = llm.logits(ids).double()
    theirs = (f32 - f64).abs().max()
    assert 5e-5 < theirs < BOUND and (ours - f64).abs().max() < 1.5 * theirs


def test_legacy_fields_read_as_transformers_reads_them() -> None:
    """The released config's `sparse_attention_config` (the indexer's sizes, the sparse layers) and `moe_layer_freq`
    give transformers' layer lists and sizes."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    cfg = {"hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 384, "head_dim": 16, "rotary_dim": 8, "moe_layer_freq": [0, 0, 1, 1, 1],
           "sparse_attention_config": {"sparse_attention_freq": [0, 1, 1, 0, 1], "sparse_num_index_heads": 2,
                                       "sparse_index_dim": 16, "sparse_block_size": 4, "sparse_topk_blocks": 3,
                                       "sparse_local_block": 2}}
    want = MiniMaxM3VLTextConfig(**cfg)
    got = m3.ModelArgs.from_dict(cfg)
    for key in ("layer_types", "mlp_layer_types", *m3.LEGACY):
        assert getattr(got, key) == getattr(want, key), key
    bare = m3.ModelArgs.from_dict({k: v for k, v in cfg.items() if k not in ("moe_layer_freq",
                                                                             "sparse_attention_config")})
    assert bare.layer_types == ["full_attention"] * 5 and bare.mlp_layer_types == ["sparse"] * 5


def test_partial_rope_follows_rotary_dim() -> None:
    """The release states its partial RoPE as `rotary_dim` (64 of 128) alone: the attention and the indexer rotate
    that many channels (transformers' port needs `partial_rotary_factor` for it: module docstring)."""
    cfg = {**tiny_config_kwargs("minimax_m3_vl_text"), "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    model, _ = build("minimax_m3_vl_text", cfg)
    assert {b.self_attn.rope.dim for b in model.model.layers} == {8}


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
def test_small_contexts_take_the_one_call_step(ckpt) -> None:
    """A context of at most index_topk_blocks x index_block_size positions never selects: no indexer keys, the
    sparse layers in the kernels' block and the whole step in one call. A larger one caches the indexer's keys (the
    block while a sequence holds that few, torch past it), and the step is layer by layer."""
    with colibri.load(ckpt.coli("minimax_m3_vl_text", "int8"), ctx_size=12, threads=2) as llm:
        sparse = [b.self_attn for b in llm.model.model.layers if isinstance(b.self_attn, m3.SparseAttention)]
        assert sparse and all(a.dense for a in sparse)
        assert native_step.one_call_shape(llm.model.model.layers) and DecodePlan(llm.model).native_layers() is not None
        short = list(llm.generate_ids(PROMPT[:4], 4, temperature=0, ignore_eos=True))
    with colibri.load(ckpt.coli("minimax_m3_vl_text", "int8"), ctx_size=64, threads=2) as llm:
        sparse = [b.self_attn for b in llm.model.model.layers if isinstance(b.self_attn, m3.SparseAttention)]
        assert not any(a.dense for a in sparse) and not native_step.one_call_shape(llm.model.model.layers)
        assert all(isinstance(c, m3.IndexedKVCache) for c in (llm.slots.caches[0][1], llm.slots.caches[0][2]))
        assert list(llm.generate_ids(PROMPT[:4], 4, temperature=0, ignore_eos=True)) == short


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme,rows", [("int8", 1), ("int8", 3), ("int4", 1)])
def test_sparse_layers_past_the_span_run_in_the_block(ckpt, scheme: str, rows: int) -> None:
    """Past index_topk_blocks x index_block_size positions (12 here) a sparse layer's rows (a decode row, a 3-row
    chunk) take the kernels' block with each row's kept blocks (coli_attn_keep): its (h + attention, post norm)
    against the torch layer's from the same caches at positions 40.. to bf16 rounding, and far off when the block
    keeps every block."""
    from colibri.layers.batch import LayerKV

    g, start = torch.Generator().manual_seed(0), 40
    with colibri.load(ckpt.coli("minimax_m3_vl_text", scheme), ctx_size=64, threads=2) as llm:
        layers = [b for b in llm.model.model.layers if isinstance(b.self_attn, m3.SparseAttention)]
        assert layers
        for b in layers:
            m, h = b.self_attn, (torch.randn(rows, 64, generator=g) * 2).to(torch.bfloat16)
            args = (b.input_layernorm, b.post_attention_layernorm)
            past = [(torch.randn(*t.shape, generator=g) * 3).to(torch.bfloat16)
                    for t in (torch.empty(2, start, 16), torch.empty(2, start, 16), torch.empty(1, start, 16))]
            kv = []
            for _ in range(3):
                cache = m.make_cache(64, torch.bfloat16)
                cache.k[:, :start], cache.v[:, :start], cache.ik[:, :start] = past
                kv.append(LayerKV([(0, rows, start, cache)], start))
            h_ref = h + m(b.input_layernorm(h), kv[0])
            x_ref = b.post_attention_layernorm(h_ref)
            h_got, x_got = m.fused(h, kv[1], *args)
            real = m3.native_msa.select
            m3.native_msa.select = lambda *a, real=real, **k: torch.ones_like(real(*a, **k))
            try:
                h_off, x_off = m.fused(h, kv[2], *args)
            finally:
                m3.native_msa.select = real
            for got, ref, off in ((h_got, h_ref, h_off), (x_got, x_ref, x_off)):
                err = (got.float() - ref.float()).abs().max()
                assert err <= 0.02 * ref.float().abs().max() and (off.float() - ref.float()).abs().max() > 4 * err


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("blk,topk,local", [(4, 3, 1), (3, 2, 2), (16, 4, 0), (128, 16, 1)])
def test_the_kernels_select_the_torch_layers_blocks(blk: int, topk: int, local: int) -> None:
    """kernels/msa.c's selection (rows of two sequences, one long) = SparseAttention._blocks' on the same queries and
    keys: topk blocks a head (all where a row has fewer), not only the first ones (so the comparison sees the
    scores)."""
    from colibri.kernels import native_msa

    cfg = {**tiny_config_kwargs("minimax_m3_vl_text"), "index_block_size": blk, "index_topk_blocks": topk,
           "index_local_blocks": local, "index_head_dim": 32}
    m = next(b.self_attn for b in build("minimax_m3_vl_text", cfg)[0].model.layers
             if isinstance(b.self_attn, m3.SparseAttention))
    g = torch.Generator().manual_seed(blk)
    seqs = [(torch.randn(700, 32, generator=g) * 2).to(torch.bfloat16), torch.randn(9, 32, generator=g).bfloat16()]
    rows = [(0, 690), (0, 699), (1, 8)]  # (sequence, position)
    iq = torch.randn(len(rows), 2, 32, generator=g)  # [T, Hi, Di]
    got = native_msa.select(iq, [seqs[s][:p + 1] for s, p in rows], blk, topk, local)
    for t, (s, p) in enumerate(rows):
        want = m._blocks(iq[t:t + 1], seqs[s][:p + 1].float(), p)[:, 0]  # [Hi, nb]
        assert torch.equal(got[t, :, :want.shape[-1]].bool(), want) and not got[t, :, want.shape[-1]:].any()
        assert (got[t].sum(-1) == min(topk, want.shape[-1])).all()  # (the local blocks among the topk)
    if got.shape[-1] > topk + local:  # (blocks past the first ones kept: the scores chose them)
        assert got[0, :, topk + local:].any()


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
def test_every_sparse_step_takes_the_block(ckpt, monkeypatch) -> None:
    """int8 decode past the span: every sparse layer of every step runs in the kernels' block (the spy sees each call
    return), as accurate against the f32 container's logits as the torch path is (test_native_accuracy.py's margins:
    over many steps a bf16 rounding may flip a near-tied block, so the two int8 paths are not compared row by row)."""
    import torch.nn.functional as F
    from test_native_step import _spy, prompt_then_decode

    ids = [(5 * i + 7) % 380 + 4 for i in range(30)]

    def logits(path, native_path: bool) -> torch.Tensor:
        taken: list[bool] = []
        with monkeypatch.context() as mp, colibri.load(path, ctx_size=64, threads=2) as llm:
            mp.setattr(m3.SparseAttention, "fused",
                       _spy(m3.SparseAttention.fused, taken) if native_path else (lambda *a: None))
            out = prompt_then_decode(llm, ids, first=1)
        if native_path:
            assert taken == [True] * (2 * len(ids))  # (two sparse layers, every position a one-row step)
        return out

    ref = logits(ckpt.coli("minimax_m3_vl_text", "f32"), False)
    path = ckpt.coli("minimax_m3_vl_text", "int8")
    (nat_cos, nat_top), (tor_cos, tor_top) = (
        (F.cosine_similarity(got, ref, dim=-1).mean(), (got.argmax(-1) == ref.argmax(-1)).float().mean())
        for got in (logits(path, True), logits(path, False)))
    assert nat_cos >= tor_cos - 0.02 and nat_top >= tor_top - 0.2 and nat_cos > 0.9


def _as_released(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One tensor of transformers' text checkpoint under the released MiniMax-M3's names (transformers' conversion
    mapping for minimax_m3_vl, reversed): per-expert w1 / w3 / w2 under `block_sparse_moe`, the dense MLPs' gate and
    up apart, the indexer's `index_*`, the text model under `language_model.`."""
    name = "language_model." + name
    for ours, theirs in (("indexer.q_proj", "index_q_proj"), ("indexer.k_proj", "index_k_proj"),
                         ("indexer.q_norm", "index_q_norm"), ("indexer.k_norm", "index_k_norm"),
                         ("mlp.gate.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias"),
                         ("mlp.gate.", "block_sparse_moe.gate."),
                         ("mlp.shared_experts.", "block_sparse_moe.shared_experts."),
                         ("mlp.experts.", "block_sparse_moe.experts.")):
        name = name.replace(ours, theirs)
    if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]
        base, half = name.removesuffix("gate_up_proj"), t.shape[1] // 2
        return {f"{base}{e}.{w}.weight": part[e] for e in range(t.shape[0])
                for w, part in (("w1", t[:, :half]), ("w3", t[:, half:]))}
    if name.endswith("experts.down_proj"):  # [E, H, I]
        return {f"{name.removesuffix('down_proj')}{e}.w2.weight": t[e] for e in range(t.shape[0])}
    if name.endswith("gate_up_proj.weight"):
        half = t.shape[0] // 2
        return {name.replace("gate_up_proj", "gate_proj"): t[:half], name.replace("gate_up_proj", "up_proj"): t[half:]}
    return {name: t}


def test_the_release_converts_to_its_text_model(ckpt, tmp_path) -> None:
    """A folder as MiniMax-M3 is released (model_type minimax_m3_vl, the text model's config under text_config, its
    tensors under the release's names, a vision tower, projectors and an MTP layer beside them) gives the text
    model's own container: the same logits as transformers' text checkpoint."""
    src = ckpt.hf("minimax_m3_vl_text")
    mm = tmp_path / "mm"
    shutil.copytree(src, mm)
    text = json.loads((src / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "minimax_m3_vl", "text_config": text,
                                                "vision_config": {"hidden_size": 8}, "image_token_index": 9}))
    tensors = {}
    for k, v in load_file(str(src / "model.safetensors")).items():
        tensors |= {n: t.contiguous() for n, t in _as_released(k, v).items()}
    assert any(".block_sparse_moe.experts.0.w3.weight" in k for k in tensors)
    tensors |= {"vision_tower.vision_model.embeddings.patch_embedding.weight": torch.randn(8, 4),
                "multi_modal_projector.linear_1.weight": torch.randn(8, 8),
                "patch_merge_mlp.linear_1.weight": torch.randn(8, 8),
                "language_model.model.mtp.0.enorm.weight": torch.randn(64)}
    (mm / "model.safetensors").unlink()
    save_file(tensors, str(mm / "model.safetensors"))
    with colibri.load(convert(mm, tmp_path / "mm.coli", "f32", progress=False), ctx_size=64) as a, \
            colibri.load(ckpt.coli("minimax_m3_vl_text", "f32"), ctx_size=64) as b:
        assert a.container.model_type == "minimax_m3_vl_text"
        assert torch.equal(a.logits(PROMPT), b.logits(PROMPT))


def test_names() -> None:
    for hf, ours in (("model.language_model.layers.3.self_attn.indexer.q_proj.weight",
                      "model.layers.3.self_attn.indexer.q_proj.weight"),
                     ("language_model.model.layers.3.self_attn.index_k_norm.weight",
                      "model.layers.3.self_attn.indexer.k_norm.weight"),
                     ("language_model.model.layers.3.block_sparse_moe.e_score_correction_bias",
                      "model.layers.3.mlp.gate.e_score_correction_bias"),
                     ("language_model.model.layers.3.block_sparse_moe.experts.7.w3.weight",
                      "model.layers.3.mlp.experts.7.w3.weight"),
                     ("language_model.lm_head.weight", "lm_head.weight"), ("lm_head.weight", "lm_head.weight"),
                     # the MTP module's (vLLM's names; tests/test_spec_mtp.py runs one)
                     ("language_model.model.mtp.layers.0.eh_proj.weight", "mtp.0.eh_proj.weight"),
                     ("language_model.model.mtp.layers.0.final_layernorm.weight", "mtp.0.norm.weight"),
                     ("language_model.model.mtp.layers.0.transformer_layer.block_sparse_moe.experts.7.w3.weight",
                      "mtp.0.block.mlp.experts.7.w3.weight")):
        assert m3.sanitize(hf) == ours
    for gone in ("model.vision_tower.blocks.0.attn.qkv.weight", "model.multi_modal_projector.linear_1.weight",
                 "vision_tower.vision_model.pre_layrnorm.weight", "patch_merge_mlp.linear_2.weight",
                 "mtp.0.enorm.weight", "model.mtp.embed_tokens.weight"):
        assert m3.sanitize(gone) is None
    # the zero-centred norms are stored as applied
    w = torch.tensor([0.5, -0.25])
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.1.self_attn.indexer.k_norm.weight", "model.layers.1.self_attn.q_norm.weight",
                 "mtp.0.enorm.weight", "mtp.0.norm.weight", "mtp.0.block.input_layernorm.weight"):
        assert torch.equal(m3.prepare(name, w, {}), torch.tensor([1.5, 0.75]))
    assert torch.equal(m3.prepare("model.layers.0.mlp.gate.weight", w, {}), w)


@pytest.mark.parametrize("change, want", [
    ({"layer_types": ["full_attention", "sparse"]}, "layer_types.*3 entries"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types.*dense / sparse"),
    ({"index_n_heads": 4}, "index_n_heads.*num_key_value_heads=2"),
    ({"index_head_dim": 4}, "index_head_dim.*rotary_dim=8"),
    ({"index_block_size": 0}, "index_block_size"),
    ({"index_topk_blocks": 0}, "index_topk_blocks"),
    ({"rotary_dim": 7}, "rotary_dim"),
    ({"rotary_dim": 32}, "rotary_dim"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type"),
])
def test_refusals(change: dict, want: str) -> None:
    cfg = {**tiny_config_kwargs("minimax_m3_vl_text"), **change}
    with pytest.raises(ColibriError, match=f"minimax_m3_vl_text.*{want}"):
        m3.check_config(cfg)
