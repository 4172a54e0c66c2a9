"""The engine both worker roles share: model, weights, paged KV cache, scheduler, sampler."""
