"""Options real checkpoints set that the tiny family builds leave at their defaults, and that select other model
code in mlx-lm (tied heads, head_dim apart from hidden / heads, partial rotary, rotary scaling in a family's own
code, a 6-layer local/global pattern, MoE routing variants, NoPE layers, qk-norm, hybrids' real layer patterns and
head layouts, ...), each on its family's tiny build with the option set (sizes scaled down: windows and original
context lengths of 8 or 16, so the prompts reach past them). Each request's tokens, staggered in chunks of 8 with
drafting on, are mlx-lm's alone."""

from __future__ import annotations

import pytest
from mlx_lm import load

from scheduler import Engine, EngineConfig
from scheduler.fixtures.families import build_family_model

from ..helpers import drive, greedy, mixed_prompts, solo_tokens

MAX_TOKENS = 8


def _llama3(factor):
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}


def _yarn(factor, **fields):
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 16, "beta_fast": 32,
            "beta_slow": 1, **fields}


def _longrope(n):
    # short and long factors apart, as Phi-3.5's and Phi-4-mini's are (mlx-lm rotates by the long ones)
    return {"type": "longrope", "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.05 * i for i in range(n)], "long_factor": [1.0 + 0.9 * i for i in range(n)]}


_MLA = {"num_hidden_layers": 3, "moe_intermediate_size": 32, "num_key_value_heads": 4, "n_shared_experts": 1,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 16, "q_lora_rank": 32,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "moe_layer_freq": 1,
        "first_k_dense_replace": 1}
# LFM2-1.2B's sixteen layers (attention at 2, 5, 8, 10, 12, 14); LFM2-8B-A1B's twenty-four (2, 6, 10, 14, 18, 21)
_LFM2_16 = ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)]
_LFM2_MOE_24 = ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]
_GEMMA3_6 = {"num_hidden_layers": 6, "sliding_window": 8, "sliding_window_pattern": 6,
             "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}

# id -> (model type, the options (whose checkpoint sets them))
OPTIONS = {
    # Llama 3.2 1B/3B: a tied head, llama3 scaling factor 32
    "llama3.2": ("llama", {"tie_word_embeddings": True, "rope_theta": 500000.0, "rope_scaling": _llama3(32.0)}),
    # Mistral Nemo (model_type mistral, loaded as llama): head_dim 128 where hidden / heads is 160
    "mistral-nemo": ("llama", {"model_type": "mistral", "head_dim": 32, "rope_theta": 1000000.0}),
    # Qwen2.5 0.5B-3B: tied; the model card's yarn for long contexts
    "qwen2.5": ("qwen2", {"tie_word_embeddings": True, "rope_scaling": _yarn(4.0)}),
    # Qwen3 0.6B-4B: tied, head_dim 128 where hidden / heads is 64
    "qwen3": ("qwen3", {"tie_word_embeddings": True, "head_dim": 32, "rope_theta": 1000000.0}),
    # gemma-2-27b: query_pre_attn_scalar (144) apart from head_dim (128)
    "gemma2": ("gemma2", {"head_dim": 32, "query_pre_attn_scalar": 24}),
    # gemma-3-1b: five local layers to a global one; gemma-3-4b and up: linear factor 8 on the global ones
    "gemma3-1b": ("gemma3_text", _GEMMA3_6),
    "gemma3-linear": ("gemma3_text", {**_GEMMA3_6, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}),
    # Phi-3.5-mini: longrope to 131072 from 4096 (an mscale); Phi-3-mini-128k's older name for it, 'su'
    "phi3.5": ("phi3", {"rope_scaling": _longrope(8), "max_position_embeddings": 512,
                        "original_max_position_embeddings": 16}),
    "phi3-su": ("phi3", {"rope_scaling": {**_longrope(8), "type": "su"}, "max_position_embeddings": 512,
                         "original_max_position_embeddings": 16}),
    # Phi-4-mini: 3/4 of each head rotated, tied, longrope
    "phi4-mini": ("phi3", {"partial_rotary_factor": 0.75, "tie_word_embeddings": True, "rope_scaling": _longrope(6),
                           "max_position_embeddings": 512, "original_max_position_embeddings": 16}),
    # DeepSeek-V3: sigmoid routing in groups with a bias correction, scaled 2.5, yarn factor 40
    "deepseek-v3": ("deepseek_v3", {**_MLA, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                                    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
                                    "rope_scaling": _yarn(40.0, type="yarn", mscale=1.0, mscale_all_dim=1.0)}),
    # DeepSeek-V2-Lite: no query compression, greedy softmax routing, yarn mscale 0.707
    "deepseek-v2-lite": ("deepseek_v2", {**_MLA, "q_lora_rank": None, "topk_method": "greedy", "n_group": 1,
                                         "topk_group": 1, "routed_scaling_factor": 1.0,
                                         "rope_scaling": _yarn(40.0, type="yarn", mscale=0.707,
                                                               mscale_all_dim=0.707)}),
    # GLM-4.5-Air: no qk-norm, one group, head_dim 128 where hidden / heads is 42
    "glm-4.5-air": ("glm4_moe", {"use_qk_norm": False, "n_group": 1, "topk_group": 1, "head_dim": 32,
                                 "routed_scaling_factor": 1.0}),
    # Olmo 3 32B: yarn factor 8 on the global layers only
    "olmo3-32b": ("olmo3", {"rope_scaling": _yarn(8.0, attention_factor=1.2), "rope_theta": 500000.0}),
    # gpt-oss: yarn factor 32, head_dim 64 where hidden / heads is 45
    "gpt-oss": ("gpt_oss", {"rope_scaling": _yarn(32.0, truncate=False), "head_dim": 32}),
    # EXAONE 3.5 2.4B: tied, llama3 scaling; EXAONE 4.0 32B: llama3 factor 16 on the global (LLLG) layers
    "exaone3.5": ("exaone", {"tie_word_embeddings": True, "rope_scaling": _llama3(8.0)}),
    "exaone4": ("exaone4", {"rope_scaling": _llama3(16.0)}),
    # SmolLM3: every fourth layer without rotary (no_rope_layer_interval 4), tied
    "smollm3": ("smollm3", {"num_hidden_layers": 4, "tie_word_embeddings": True, "rope_theta": 5000000.0}),
    # Falcon-H1's trained checkpoints: a gated RMS norm in the mamba mixer; the larger ones untied
    "falcon-h1": ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": False,
                                "tie_word_embeddings": False}),
    # Hunyuan dense (7B, 4B): 'dynamic' with an NTK alpha, a fixed base (not mlx-lm's DynamicNTKScalingRoPE)
    "hunyuan-dense": ("hunyuan_v1_dense", {"rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
                                           "tie_word_embeddings": True, "head_dim": 32}),
    # Command R+: per-head qk layer norms
    "command-r-plus": ("cohere", {"use_qk_norm": True}),
    # Seed-OSS-36B: q/k/v biases, head_dim 128 where hidden / heads is 64
    "seed-oss": ("seed_oss", {"attention_bias": True, "head_dim": 32, "rope_theta": 10000000.0}),
    # ERNIE-4.5-0.3B: head_dim 128 where hidden / heads is 64
    "ernie4.5": ("ernie4_5", {"head_dim": 32}),
    # Qwen3-Next: a quarter of each head rotated, three linear-attention layers to a full one
    "qwen3-next": ("qwen3_next", {"partial_rotary_factor": 0.25, "full_attention_interval": 4, "head_dim": 32}),
    # Nemotron-H / Nemotron Nano 9B v2: Mamba-2 B and C in 8 groups (16 heads each; here 2), a group-wise gated norm
    "nemotron-h": ("nemotron_h", {"mamba_num_heads": 16, "mamba_head_dim": 8, "n_groups": 8,
                                  "hybrid_override_pattern": ["M", "-", "M", "*", "M", "-"]}),
    # Mamba-Codestral-7B: 8 groups, time steps clipped to [0, inf)
    "mamba-codestral": ("mamba2", {"num_heads": 16, "head_dim": 8, "n_groups": 8,
                                   "time_step_limit": [0.0, float("inf")]}),
    # Granite 4.0 H: attention layers without rotary (position_embedding_type nope)
    "granite-4.0-h": ("granitemoehybrid", {"position_embedding_type": "nope", "mamba_n_heads": 8, "mamba_d_head": 16}),
    # Falcon Mamba 7B (model_type falcon_mamba, loaded as mamba): RMS norms on B, C and dt
    "falcon-mamba": ("mamba", {"model_type": "falcon_mamba", "tie_word_embeddings": False}),
    # RWKV-7 (fla-hub): heads of 64 (one here), low ranks a 64, decay 64, gate 128, v 32 at hidden 768
    "rwkv7": ("rwkv7", {"head_dim": 64, "num_hidden_layers": 3, "intermediate_size": 256, "a_low_rank_dim": 8,
                        "decay_low_rank_dim": 8, "gate_low_rank_dim": 16, "v_low_rank_dim": 4}),
    # Baichuan-M1-14B: odd layers sliding (the first global), with more and narrower heads (40 / 8 kv of 128)
    # than the global ones (20 / 2 kv of 256); a window of 8192 (8 here)
    "baichuan-m1": ("baichuan_m1", {"num_attention_heads": 2, "num_key_value_heads": 1,
                                    "num_swa_attention_heads": 4, "num_swa_key_value_heads": 2,
                                    "sliding_window_layers": [1, 3]}),
    # LFM2-1.2B: its layer pattern, 4 query heads a kv head, the FFN width auto-adjusted (2/3, multiple of 256)
    "lfm2-1.2b": ("lfm2", {"num_hidden_layers": 16, "layer_types": _LFM2_16, "num_key_value_heads": 1,
                           "block_auto_adjust_ff_dim": True, "block_ff_dim": 192, "rope_theta": 1000000.0}),
    # LFM2-8B-A1B: its layer pattern, two dense layers, 32 experts (4 a token) with an expert bias
    "lfm2-8b-a1b": ("lfm2_moe", {"num_hidden_layers": 24, "layer_types": _LFM2_MOE_24, "num_dense_layers": 2,
                                 "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
                                 "num_key_value_heads": 1}),
    # Olmo-Hybrid-7B: three gated delta-net layers to an attention one, no rotary (rope_parameters null, the
    # converter's rope_theta null), full key-value heads, value heads twice as wide as key heads
    "olmo-hybrid": ("olmo_hybrid", {"num_hidden_layers": 8, "layer_types": ["linear_attention"] * 3 +
                                    ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
                                    "num_key_value_heads": 4, "linear_num_key_heads": 4, "linear_value_head_dim": 32,
                                    "rope_parameters": None, "rope_theta": None}),
    # Ring-mini-linear-2.0: 20 layers in groups of 5 (attention at 4, 9, 14, 19), the gate's norm in groups of 4,
    # 16 heads (4 kv), 8 of 256 experts routed in 8 groups (top 4 groups), a shared expert
    "ring-mini-linear-2.0": ("bailing_moe_linear", {
        "hidden_size": 128, "num_hidden_layers": 20, "layer_group_size": 5, "group_norm_size": 4,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 8, "num_experts": 16, "num_experts_per_tok": 8,
        "n_group": 8, "topk_group": 4, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16,
        "norm_head": False, "rope_theta": 1000000.0}),
    # Ling-2.5 (BailingMoeV2_5): one latent-attention layer to seven linear ones, no query compression
    "ling-2.5": ("bailing_hybrid", {"num_hidden_layers": 16, "layer_group_size": 8, "group_norm_size": 4,
                                    "num_attention_heads": 8, "head_dim": 8, "q_lora_rank": None, "num_experts": 16,
                                    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                                    "moe_intermediate_size": 16}),
    # Ling-3.0 (model_type bailing_hybrid, architecture BailingMoeV3ForCausalLM, which mlx-lm loads as
    # bailing_moe_v3; the engine takes bailing_hybrid's facts): delta-rule (KDA) layers, latent attention every
    # fourth; the tiny bailing_moe_v3 build (2 layers < a group) has no KDA layer
    "ling-3.0": ("bailing_moe_v3", {
        "model_type": "bailing_hybrid", "architectures": ["BailingMoeV3ForCausalLM"], "num_hidden_layers": 8,
        "layer_group_size": 4, "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "num_experts": 16, "num_experts_per_tok": 8,
        "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16}),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_real_checkpoint_options_batch_exactly(name, tmp_path):
    model_type, options = OPTIONS[name]
    model, tokenizer = load(str(build_family_model(model_type, tmp_path, overrides=options)))
    prompts = mixed_prompts(5, 1, 60, seed=1)
    prompts.append(prompts[1])  # repeated: its drafts are accepted
    config = EngineConfig(max_batched_tokens=24, max_seqs=8, prefill_chunk=8, draft_tokens=2, check_invariants=True)
    run = drive(Engine(model, tokenizer, config),
                [(2 * i, {"prompt_tokens": p, "sampling": greedy(MAX_TOKENS), "request_id": str(i)})
                 for i, p in enumerate(prompts)])
    assert not run.errors, run.errors
    assert run.tokens == {str(i): solo_tokens(model, tokenizer, p, MAX_TOKENS) for i, p in enumerate(prompts)}


def test_recurrent_gemma_refuses_a_one_token_prompt_and_batches_the_rest_exactly(tmp_path):
    """RecurrentGemma 2B's recurrent, recurrent, attention stack on six tiny layers. mlx-lm's RG-LRU leaves a
    sequence's first input unscaled only when it runs with no recurrent state; a one-token prompt's only token is the
    first decode step's input, computed in the batched forward where its row holds the batch's zero state (its
    logits 0.48 away from alone; greedy tokens [89, 470, ...] against [352, 447, ...] next to a 9-token prompt). So
    such a prompt is refused at add_request with the reason (`Family.min_prompt`), and a 2-token and a 9-token
    prompt (longer than the window of 8), all at once, are each mlx-lm's alone."""
    from scheduler import InvalidRequest

    model, tokenizer = load(str(build_family_model("recurrent_gemma", tmp_path, overrides={"num_hidden_layers": 6})))
    one, nine = [mixed_prompts(5, 1, 60, seed=1)[i] for i in (0, 2)]
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=512, max_seqs=16, prefill_chunk=256))
    with pytest.raises(InvalidRequest, match="prompt: has 1 token.*at least 2: recurrent_gemma's RG-LRU"):
        engine.add_request(prompt_tokens=one, sampling=greedy(4))
    prompts = [nine[:2], nine]
    run = drive(engine, [(0, {"prompt_tokens": p, "sampling": greedy(4), "request_id": str(i)})
                         for i, p in enumerate(prompts)])
    assert run.tokens == {str(i): solo_tokens(model, tokenizer, p, 4) for i, p in enumerate(prompts)}
