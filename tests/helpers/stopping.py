"""A random tiny model that ends its turns after a few tokens (one rarely draws the stop token by itself)."""

import torch


def stop_early(model, logit: float = 4.0):
    """In place: a bias on the last layer's values adds a constant to every position's hidden state (attention
    weights sum to 1), and the stop token's output row along their mean gives it a logit of ~`logit`."""
    v = model.model.layers[-1].self_attn.v_proj
    with torch.no_grad():
        v.bias.copy_(torch.linspace(-3, 3, v.bias.numel()))
        mean = model.model(input_ids=torch.randint(4, 200, (8, 24))).last_hidden_state.mean((0, 1))
        model.lm_head.weight[model.config.eos_token_id] = logit * mean / mean.norm() ** 2
    return model
