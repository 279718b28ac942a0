"""attn_implementation="attnx" on tiny random-weight transformers models (no downloads): same logits, same tokens."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnx  # noqa: E402
import attnx.compat.transformers as attnx_transformers  # noqa: E402
from attnx.compat import CompatArgumentError  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def _models():
    """name: (model class, config, the implementation to compare with)."""
    found = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**COMMON), "sdpa"),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(**COMMON, sliding_window=8), "sdpa"),
        # transformers' sdpa path refuses softcap: Gemma-2 is compared with eager
        "gemma2": (transformers.Gemma2ForCausalLM,
                   transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=8, attn_logit_softcapping=20.0,
                                             final_logit_softcapping=30.0), "eager"),
    }
    if hasattr(transformers, "GptOssForCausalLM"):
        found["gpt-oss"] = (transformers.GptOssForCausalLM,
                            transformers.GptOssConfig(**dict(COMMON, intermediate_size=64), head_dim=16,
                                                      num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
                            "eager")
    return found


MODELS = _models()


@pytest.fixture(scope="module")
def name():
    return attnx_transformers.register()


def _build(model, config, implementation):
    torch.manual_seed(0)
    m = model(type(config)(**config.to_dict())).eval()
    if hasattr(m.model.layers[0].self_attn, "sinks"):  # gpt-oss: non-zero sinks, so they matter
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.sinks.normal_()
    m.set_attn_implementation(implementation)
    return m


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    return ids, mask


def test_register_adds_the_name(name):
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert name == "attnx"
    assert "attnx" in AttentionInterface() and "attnx" in ALL_MASK_ATTENTION_FUNCTIONS


@pytest.mark.parametrize("model_name", MODELS)
def test_logits_and_greedy_generation_match(name, model_name):
    model, config, reference = MODELS[model_name]
    ours, theirs = _build(model, config, name), _build(model, config, reference)
    ids, mask = _batch()
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits
    keep = mask.bool()  # padded positions attend to nothing: their logits are not compared
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
    tokens = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)  # past the window of 8
    assert torch.equal(tokens, theirs.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model_name", MODELS)
def test_gpu_bf16_logits_and_greedy_generation_match(name, model_name):
    """The same models in bfloat16 on a GPU (issue 12: on the H200): logits within bf16 rounding of the
    reference implementation's, the same greedy tokens."""
    model, config, reference = MODELS[model_name]
    ours, theirs = (_build(model, config, impl).to("cuda", torch.bfloat16) for impl in (name, reference))
    ids, mask = (t.cuda() for t in _batch())
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep].float(), want[keep].float(), atol=3e-2, rtol=3e-2)
    tokens = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    _assert_same_greedy_tokens_up_to_a_tie(tokens, theirs.generate(ids, attention_mask=mask, max_new_tokens=12,
                                                                    do_sample=False), theirs, mask, tol=3e-2)


def _assert_same_greedy_tokens_up_to_a_tie(tokens, want, reference, mask, tol):
    """The same greedy tokens, or tokens that part only where the reference's own two best logits are
    within `tol` (relative) of each other, our token being one of them: bf16 rounding of attention (or
    of a mixture-of-experts router fed by it) may flip such an argmax (gpt-oss on the H200, 2026-12-02),
    and after that step the continuations are different inputs, so they are not compared."""
    if torch.equal(tokens, want):
        return
    differs = (tokens != want).any(0).nonzero()
    step = int(differs[0])
    row = int((tokens[:, step] != want[:, step]).nonzero()[0])
    prefix = want[row:row + 1, :step]
    prefix_mask = torch.cat([mask[row:row + 1], mask.new_ones(1, step - mask.shape[1])], dim=1)
    with torch.no_grad():
        logits = reference(prefix, attention_mask=prefix_mask).logits[0, -1].float()
    best = float(logits.max())
    gap = best - float(logits[tokens[row, step]])
    assert gap <= tol * max(1.0, abs(best)), (
        f"greedy tokens part at step {step} (row {row}) where the reference's logit gap {gap:.3g} is not a tie")


def test_static_cache_generation_matches(name):
    model, config, reference = MODELS["llama"]
    ours, theirs = _build(model, config, name), _build(model, config, reference)
    ids = torch.randint(0, 128, (1, 10))
    kwargs = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(ours.generate(ids, **kwargs), theirs.generate(ids, **kwargs))


def test_forced_backend_and_training_dropout(ran):
    forced = attnx_transformers.register("attnx-naive", backend="naive")
    model, config, _ = MODELS["llama"]
    m = _build(model, config, forced)
    ids, mask = _batch()
    with torch.no_grad():
        m(ids, attention_mask=mask)
    assert ran and {backend for backend, _ in ran} == {"naive"}
    dropping = _build(model, type(config)(**dict(config.to_dict(), attention_dropout=0.1)), forced).train()
    with pytest.raises(CompatArgumentError, match="dropout"):
        dropping(ids, attention_mask=mask)


def test_register_rejects_unknown_backend():
    with pytest.raises(attnx.InvalidArgumentError):
        attnx_transformers.register("attnx-bad", backend="no-such-backend")
