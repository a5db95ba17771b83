"""The one-call native step (engine/native_step.py, kernels/step.c) and the fused blocks it strings together,
against the same kernels called one by one from Python: every family whose layers it takes, bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_native import PROMPTS

from colibri.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")


def _steps(llm, mode: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """Logits of one-row steps, a two-sequence decode step and a 6-row prompt chunk: the whole step in one
    native call ("whole": embedding, blocks, norm, head), all blocks in one call ("one_call"), the fused
    blocks one layer at a time ("fused"), or neither ("unfused")."""
    from colibri.engine.decode_plan import DecodePlan
    from colibri.layers.attention import Attention
    from colibri.layers.batch import Seq, StepBatch
    from colibri.layers.moe import SparseMoE

    out: dict[str, torch.Tensor] = {}
    plan = DecodePlan(llm.model, native=mode in ("whole", "one_call"), whole_step=mode == "whole")
    with monkeypatch.context() as mp:
        if mode == "unfused":
            mp.setattr(Attention, "fused", lambda self, *a: None)
            mp.setattr(SparseMoE, "fused", lambda self, *a: None)
        s0, s1 = llm.slots.caches[0], llm.slots.caches[1]
        with torch.inference_mode():
            rows = []
            for caches, ids in ((s0, PROMPTS[0]), (s1, PROMPTS[1][:9])):
                for pos, tok in enumerate(ids):
                    rows.append(plan.step(torch.tensor([tok]), StepBatch.single(caches, pos, 1), torch.tensor([0])))
            out["rows"] = torch.cat(rows)
            # both sequences' next token in one step, at positions 16 and 9 (each on its own cache)
            batch = StepBatch([Seq(0, 1, len(PROMPTS[0]), s0), Seq(1, 2, 9, s1)])
            out["batch"] = plan.step(torch.tensor([5, 6]), batch, torch.tensor([0, 1]))
            out["chunk"] = plan.step(torch.tensor(PROMPTS[1][:6]), StepBatch.single(s1, 0, 6), torch.arange(6))
    return out


def _spy(real, seen: list[bool]):
    def spy(*a, **kw):
        r = real(*a, **kw)
        seen.append(r is not None)
        return r
    return spy


def prompt_then_decode(llm, prompt: list[int], first: int = 4, routes: list | None = None) -> torch.Tensor:
    """Logits f32 [1 + len(prompt) - first, V] on slot 0: the last of the prompt's first `first` rows (one step),
    then each later token as a decode step (what the kernel tests compare path against path); `routes` gets each
    step's (layer, ids, weights) as lists, layer by layer."""
    from colibri.layers.batch import StepBatch

    cache, rows = llm.slots.caches[0], []
    llm.plan.take_routes()
    with torch.inference_mode():
        for lo, hi in [(0, first), *((p, p + 1) for p in range(first, len(prompt)))]:
            # (a prompt's first rows take torch on every path where it differs)
            rows.append(llm.plan.step(torch.tensor(prompt[lo:hi]), StepBatch.single(cache, lo, hi - lo),
                                      torch.tensor([hi - lo - 1])))
            if routes is not None:
                routes.extend((layer, i.tolist(), w.tolist()) for layer, (i, w) in
                              sorted(llm.plan.take_routes().items()))
    return torch.cat(rows).float()


@pytest.mark.parametrize("model_type,overrides", [
    ("olmoe", {"clip_qkv": 0.5}), ("qwen3_moe", {}), ("mixtral", {"sliding_window": 5}), ("minimax_m2", {}),
    # q/k/v biases, a gated shared expert, a dense layer (int4 needs a shared width of 32s)
    ("qwen2_moe", {"shared_expert_intermediate_size": 64}),
    # biases, partial RoPE, q/k norm, a dense first layer, shared experts (the kernels' one-group router)
    ("glm4_moe", {"n_group": 1, "topk_group": 1}), ("dots1", {"n_group": 1, "topk_group": 1}),
    ("glm4_moe", {}),  # (the tiny config's two router groups, one kept: kernels/moe.c keep_groups)
    ("ernie4_5_moe", {}),  # (its softmax router with a selection bias)
    ("ernie4_5_vl_moe_text", {}),  # (the same layers, M-RoPE's text positions; dense layer 0 by mlp_layer_types)
    ("qwen3_omni_moe_text", {}),  # (Qwen3-MoE's layers, M-RoPE's text positions, a dense layer)
    ("aria_text", {}),  # (q/k/v/o biases, Mixtral's router, shared experts in every layer)
    ("gpt_oss", {}),  # (q/k/v/o biases, sinks, its router, its experts' activation and biases)
    # the L2 q/k norm after RoPE, a layer without RoPE and its temperature, chunked attention, the expert's
    # scaled input, dense layers between MoE ones
    ("llama4_text", {}),
    ("hunyuan_v1_moe", {}),  # (its per-head q/k norm after the rotary: QKNorm.HEAD_POST_ROPE with weights)
    ("exaone_moe", {}),  # (q/k norm, full layers without the rotary, sliding ones, a grouped router)
    # Mistral 4: DeepSeek-V3's MLA and a softmax router, queries unscaled below original_max_position_embeddings
    ("mistral4", {"q_lora_rank": 32, "kv_lora_rank": 32, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}}),
    # MiMo-V2-Flash: values narrower than q/k and scaled, sliding layers with sinks and more KV heads, each layer type
    # its own RoPE as released (the sliding layers' tables their own: coli_attn_layer.rotary), and one RoPE for both
    ("mimo_v2_flash", {}),
    ("mimo_v2_flash", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.334},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.334}}}),
    # Qwen3-Next's gated attention (q_proj's per-head output gate: the block's `gate`) in every layer
    ("qwen3_next", {"layer_types": ["full_attention"] * 3, "shared_expert_intermediate_size": 64}),
    # MLA (kernels/mla.c) in the attention block's place: q_proj and interleaved RoPE; q LoRA
    ("deepseek_v2", {"topk_method": "greedy", "kv_lora_rank": 32}),
    ("deepseek_v2", {"kv_lora_rank": 32}),  # (group_limited_greedy, 2 of 4 groups)
    ("deepseek_v3", {"n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 32}),
    ("glm4_moe_lite", {"q_lora_rank": 32, "kv_lora_rank": 32}),  # (a sparse layer 0, v wider than q/k's nope part)
    # Phi-3.5-MoE: LayerNorms in the attention block and the tail, the head's bias, the sparsemixer router
    ("phimoe", {}),
    ("solar_open", {}),  # (GLM's MoE layers in every layer, two router groups; Llama's attention with q/k/v biases)
    ("granitemoe", {}),  # (gpt-oss's router rule with no bias and a scale, the attention's own score scale)
    ("dbrx", {}),  # (LayerNorms without a bias in the block and the tail, q/k/v clamped)
    ("granitemoe_swa", {}),  # (Granite's shared expert; sinks, sliding layers, a layer without RoPE)
    ("afmoe", {}),  # (each sublayer's output norm, the gated attention, a dense layer 0, a full layer without RoPE)
    ("flex_olmo", {}),  # (no norm before a sublayer: the block's NULL norm weights; the output norms)
    ("hy_v3", {}),  # (GLM's one-group router scaled after renormalising; per-head q/k norm over a wide head)
    ("flint", {}),  # (sinks, sliding layers, a full layer without RoPE; the sigmoid router with a zero bias)
    ("kolibri1", {}),  # (output norms, a full layer without RoPE; the router choosing by logit + bias)
    ("axk1", {"q_lora_rank": 32, "kv_lora_rank": 32}),  # (MLA, the MoE block's output norm, two router groups)
    # A.X K2: MLA with the gated query and output gate, the gated norms (the dense layer's post norm plain); its
    # indexer never selects within this context (index_topk 64), so the one call takes it
    ("axk2", {"q_lora_rank": 32, "kv_lora_rank": 32, "index_topk": 64}),
    ("beam", {}),  # (the gate's bias a head, the full layer's query scale table, the depth-scaled norms' eps)
    # MiniMax-M3: its sparse layers within index_topk_blocks x index_block_size (64) positions, the clamped SwiGLU of
    # the dense layer and the shared expert in the kernels' MLP call
    ("minimax_m3_vl_text", {"index_topk_blocks": 16}),
    ("mellum", {}),  # (a RoPE base per layer type, a sliding layer, a dense one)
    ("cohere2_moe", {}),  # (parallel blocks: the MLP reads the attention's input norm; LayerNorms; NoPE layers)
    # Laguna: the softplus output gate (OutGate.HEAD_SOFTPLUS, OutGate.CHANNEL_SOFTPLUS), heads and RoPE per layer
    ("laguna", {}), ("laguna", {"gating": "per-element"})])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_fused_blocks_give_the_unfused_bits(ckpt, monkeypatch, model_type, overrides, scheme) -> None:
    """coli_attn_block (norm, q/k/v and their biases, q/k norm, clip, rotary, cache write, attention,
    o_proj, residual, post norm in one call; or DeepSeek's coli_mla_block) and
    coli_moe_block (router, experts, shared expert, residual;
    or a dense layer's MLP) give exactly the bits of the
    same kernels called one by one from Python, for one-row steps and a two-sequence step; so do
    coli_decode_layers (all blocks of a step in one call) and coli_decode_step (embedding to logits in
    one call); a prompt chunk through them (rows attend
    over their own predecessors, written in the same call) matches the one-row steps."""
    import colibri
    from colibri.kernels import native
    from colibri.layers.mla import MLAttention
    from colibri.layers.moe import SparseMoE

    llm = colibri.load(ckpt.coli(model_type, scheme, **overrides), ctx_size=64, slots=2, threads=2)
    for b in llm.model.model.layers:  # MLA: the absorbed form (the block's) for every step, the first ones too
        if isinstance(b.self_attn, MLAttention):
            b.self_attn.mode = "absorbed"
    try:
        taken: dict[type, list[bool]] = {type(b.self_attn): [], SparseMoE: []}  # per call: did the native block run
        with monkeypatch.context() as mp:
            for cls, seen in taken.items():
                mp.setattr(cls, "fused", _spy(cls.fused, seen))
            got = _steps(llm, "fused", monkeypatch)
        assert all(seen and all(seen) for seen in taken.values())  # every layer of every step was fused
        one_call: list[bool] = []
        with monkeypatch.context() as mp:
            mp.setattr(native, "decode_layers", _spy(native.decode_layers, one_call))
            blocks = _steps(llm, "one_call", monkeypatch)
        assert len(one_call) == len(PROMPTS[0]) + 9 + 2 and all(one_call)  # every step's blocks in one call
        whole_calls: list[bool] = []
        with monkeypatch.context() as mp:
            mp.setattr(native, "decode_step", _spy(native.decode_step, whole_calls))
            whole = _steps(llm, "whole", monkeypatch)
        assert len(whole_calls) == len(PROMPTS[0]) + 9 + 2  # every step whole: embedding to logits
        ref = _steps(llm, "unfused", monkeypatch)
    finally:
        llm.close()
    for key in ("rows", "batch", "chunk"):
        assert torch.equal(whole[key], got[key])
        assert torch.equal(blocks[key], got[key])
    assert torch.equal(got["rows"], ref["rows"])
    assert torch.equal(got["batch"], ref["batch"])
    # the chunk's rows are positions 0..5 of PROMPTS[1], which the one-row steps also computed (rows 16..21)
    one_row = got["rows"][len(PROMPTS[0]) : len(PROMPTS[0]) + 6]
    assert (got["chunk"].float() - one_row.float()).abs().max() <= 0.05 * one_row.float().abs().max()
    assert torch.equal(got["chunk"].argmax(-1), one_row.argmax(-1))


def test_one_call_step_follows_replaced_caches(ckpt) -> None:
    """The one-call step (coli_decode_step) caches a slot's KV pointers: a cache whose tensors are replaced
    (moved, reallocated) must be written at its new memory (the last step, per layer, reads from there)."""
    import colibri
    from colibri.engine.decode_plan import DecodePlan
    from colibri.kernels import native as nat
    from colibri.layers.batch import StepBatch

    llm = colibri.load(ckpt.coli("olmoe", "int8"), ctx_size=32, slots=1, threads=2)
    torch_plan = DecodePlan(llm.model, native=False)
    calls: list[bool] = []
    real = nat.decode_step
    try:
        nat.decode_step = _spy(real, calls)
        caches = llm.slots.caches[0]

        def run(replace: bool) -> torch.Tensor:
            with torch.inference_mode():
                for c in caches:
                    c.k.zero_()
                    c.v.zero_()
                for pos, tok in enumerate(PROMPTS[0][:6]):
                    plan = llm.plan if pos < 5 else torch_plan
                    out = plan.step(torch.tensor([tok]), StepBatch.single(caches, pos, 1), torch.tensor([0]))
                    if replace and pos == 2:
                        for c in caches:
                            c.k, c.v = c.k.clone(), c.v.clone()
            return out

        ref = run(False)
        got = run(True)
    finally:
        nat.decode_step = real
        llm.close()
    assert len(calls) == 10 and all(calls)  # positions 0-4 of both runs in one call
    assert torch.equal(got, ref)


def test_read_ahead_between_steps_changes_nothing(ckpt) -> None:
    """After a one-call step, a pool worker reads the next step's first weights (kernels/step.c pf_job)
    until the next step starts: greedy tokens and their logprobs are the same without it, with it, and
    with it reading far past where a step stops it; `background_wait` returns once it is over."""
    import ctypes

    import colibri
    from colibri.kernels import native as nat

    llm = colibri.load(ckpt.coli("olmoe", "int4"), ctx_size=64, threads=2)
    size = ctypes.c_long.in_dll(nat._lib, "coli_pf_bytes")
    default = size.value
    runs = []
    try:
        for n in (0, default, 1 << 40):
            size.value = n
            h = llm.submit(PROMPTS[0], max_tokens=12, ignore_eos=True, temperature=0, logprobs=0)
            runs.append([(e.token, e.logprob) for e in h])
            nat.background_wait()
    finally:
        size.value = default
        llm.close()
    assert default > 0 and len(runs[0]) == 12
    assert runs[1] == runs[0] and runs[2] == runs[0]
