"""Model FLOPs (hetero.kinds.flops; each kind's closed form in its folder, reached through
``Kind.forward_flops``) against closed forms computed here and against torch's flop counter."""

from dataclasses import replace

import torch
from torch.utils.flop_counter import FlopCounterMode

from hetero.kinds.flops import TRAINING_MULTIPLIER, counted_forward_flops
from hetero.models import default_registry
from hetero.models.gpt.flops import gpt_forward_flops_per_token
from hetero.models.vit.flops import vit_forward_flops_per_image
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.gpt.config import GPTConfig
from hetero.models.vit.model import VisionEncoder
from hetero.models.vit.config import ViTConfig


def test_gpt_training_flops_match_megatron_closed_form():
    # Megatron-LM's count for a GPT of l layers, width h, vocabulary V, batch B of s tokens:
    # 72 B s l h^2 (1 + s / (6h) + V / (12 h l)). It assumes 4h^2 of MLP weights per layer (8h^2 of MLP
    # FLOPs per token); a SwiGLU of ffn = 8h/3 has exactly that, and full multi-head attention.
    h, layers, vocab, s, batch = 96, 3, 256, 64, 2
    config = GPTConfig(vocab_size=vocab, hidden_size=h, num_layers=layers, num_heads=4, ffn_hidden_size=8 * h // 3, seq_len=s)
    megatron = 72 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * h * layers))
    ours = TRAINING_MULTIPLIER * batch * s * gpt_forward_flops_per_token(config)
    assert abs(ours - megatron) / megatron < 1e-12


def _linear_weights(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_gpt_flops_from_parameter_count_and_counter():
    # Grouped-query attention and a SwiGLU of any width: 2 FLOPs per weight per token, plus the score and
    # value products (2 * 2 * s * h per token per layer over the full s x s matrix).
    config = GPTConfig(vocab_size=200, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, ffn_hidden_size=160, seq_len=48)
    model = GPT(config)
    batch, s = 3, config.seq_len
    by_weights = batch * s * (2 * _linear_weights(model) + config.num_layers * 4 * s * config.hidden_size)
    assert batch * s * gpt_forward_flops_per_token(config) == by_weights
    tokens = torch.randint(0, config.vocab_size, (batch, s))
    assert counted_forward_flops(model, tokens) == by_weights
    # Training: torch's counter sees the backward's matmuls at twice the forward's (the CPU attention
    # kernel is not in its table, so compare the matmul part).
    with FlopCounterMode(display=False) as counter:
        token_loss_sum(model(tokens), tokens).backward()
    matmuls = batch * s * 2 * _linear_weights(model)
    assert counter.get_total_flops() == TRAINING_MULTIPLIER * matmuls


def test_latent_attention_flops_from_parameter_count_and_counter():
    """Multi-head latent attention: 2 FLOPs per weight per token, plus QK^T over q's width and attention·V
    over v's (2 · s · heads · (head_dim + v_head_dim) per token per layer); torch's counter agrees."""
    for q_lora_rank in (0, 24):
        config = GPTConfig(vocab_size=200, hidden_size=64, num_layers=2, num_heads=4, head_dim=20, rotary_dim=8,
                           kv_lora_rank=16, q_lora_rank=q_lora_rank, v_head_dim=12, ffn_hidden_size=96, seq_len=48)
        model = GPT(config)
        s = config.seq_len
        attention = config.num_layers * 2 * s * config.num_heads * (config.head_size + config.v_size)
        assert 3 * s * gpt_forward_flops_per_token(config) == 3 * s * (2 * _linear_weights(model) + attention)
        assert counted_forward_flops(model, torch.randint(0, 200, (3, s))) == 3 * s * gpt_forward_flops_per_token(config)


def test_moe_flops_count_active_experts():
    """A mixture of experts costs what a token goes through: its top_k experts and the shared ones, and
    the router; torch's counter agrees on a dropless forward (every token takes top_k experts)."""
    dense = GPTConfig(vocab_size=200, hidden_size=64, num_layers=2, num_heads=8, ffn_hidden_size=192, seq_len=48)
    moe = replace(dense, num_experts=6, top_k=2, expert_ffn_size=64, shared_experts=1)
    router = 2 * moe.hidden_size * moe.num_experts * moe.num_layers
    assert gpt_forward_flops_per_token(moe) == gpt_forward_flops_per_token(dense) + router
    tokens = torch.randint(0, moe.vocab_size, (3, moe.seq_len))
    assert counted_forward_flops(GPT(moe), tokens) == 3 * moe.seq_len * gpt_forward_flops_per_token(moe)


def test_vit_flops_from_parameter_count():
    config = ViTConfig(image_size=16, patch_size=4, channels=3, hidden_size=32, num_layers=3, num_heads=4,
                       feature_layer=-2, out_size=48)
    model = VisionEncoder(config)
    s, p = config.seq_len, config.num_patches  # the class token runs through the blocks, not the projector
    block_weights = sum(_linear_weights(b) for b in model.layers.values())
    expected = (2 * p * model.patch_embed.weight.numel() + s * 2 * block_weights
                + len(model.layers) * 4 * s * s * config.hidden_size
                + 2 * p * (model.projector.proj_in.weight.numel() + model.projector.proj_out.weight.numel()))
    assert len(model.layers) == 2  # blocks after feature_layer never run and are not counted
    assert vit_forward_flops_per_image(config) == expected
    assert counted_forward_flops(model, torch.randn(2, 3, 16, 16)) == 2 * expected
    handing_on = replace(config, class_feature=True)  # the class token's features go through the projector too
    assert counted_forward_flops(VisionEncoder(handing_on), torch.randn(2, 3, 16, 16)) == \
        2 * vit_forward_flops_per_image(handing_on) > 2 * expected


def test_planner_prices_experts_by_the_units_a_token_uses():
    """The cost model computes a mixture of experts' active units (top_k + shared) and holds every expert's
    weights: as a dense MLP of the active width for time, of all the experts' width for memory."""
    from hetero.plan.cost import describe

    moe = GPTConfig(vocab_size=200, hidden_size=64, num_layers=2, num_heads=8, seq_len=48, num_experts=6, top_k=2,
                    expert_ffn_size=64, shared_experts=1)
    view = describe("llm", "gpt", moe)
    assert view.ffn == 3 * 64 and view.idle_ffn == 4 * 64
    assert view.params == describe("llm", "gpt", replace(moe, num_experts=0, ffn_hidden_size=7 * 64)).params
    assert view.model_flops_per_sample == TRAINING_MULTIPLIER * moe.seq_len * gpt_forward_flops_per_token(moe)


def test_each_kind_brings_its_flops_through_the_registry():
    """``Kind.forward_flops``: one sample's forward by the kind's closed form (a GPT's row, a tower's or a
    projector's image); None for the kinds counted with torch's flop counter instead."""
    kinds = default_registry()
    llm = GPTConfig(vocab_size=200, hidden_size=64, num_layers=2, num_heads=8, ffn_hidden_size=160, seq_len=48)
    assert kinds["gpt"].forward_flops(llm) == llm.seq_len * gpt_forward_flops_per_token(llm)
    tower = ViTConfig(image_size=16, patch_size=4, channels=3, hidden_size=32, num_layers=3, num_heads=4, out_size=48)
    assert kinds["vit"].forward_flops(tower) == vit_forward_flops_per_image(tower)
    projector = kinds["projector"].config(in_size=32, out_size=48, tokens=16)
    model = kinds["projector"].build(projector)
    assert kinds["projector"].forward_flops(projector) == counted_forward_flops(model, torch.randn(1, 16, 32))
    assert kinds["genezip"].forward_flops(kinds["genezip"].config()) is None
    assert kinds["video"].forward_flops(kinds["video"].config()) is None
