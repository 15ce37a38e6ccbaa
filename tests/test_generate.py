"""Generation past the model's context slides the window instead of stopping or using untrained positions."""

import torch

from conftest import byte_gpt2_config
from shardlm.generate import generate_tokens

NEVER = -1  # an EOS id no model emits


def tiny_model(n_positions: int = 16):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(byte_gpt2_config(n_positions=n_positions, n_embd=32, n_head=2)).eval()


def test_generation_slides_past_the_context():
    model, prompt = tiny_model(16), [97, 98, 99]
    [new] = generate_tokens(model, prompt, max_new_tokens=40, eos=NEVER, temperature=0)
    assert len(new) == 40  # not clipped to the 13 tokens that fit in one context
    ids = prompt + new
    first_round = model.generate(torch.tensor([prompt]), max_new_tokens=13, do_sample=False, pad_token_id=256,
                                 eos_token_id=NEVER)
    assert ids[:16] == first_round[0].tolist()
    # the second round continues from the last half-context (8 tokens) with a fresh cache
    with torch.no_grad():
        assert ids[16] == model(torch.tensor([ids[8:16]])).logits[0, -1].argmax().item()


def test_samples_are_seeded_and_cut_after_eos():
    model = tiny_model()
    a = generate_tokens(model, [120], 30, NEVER, temperature=1.0, top_k=5, seed=3, num_samples=2)
    assert a == generate_tokens(model, [120], 30, NEVER, temperature=1.0, top_k=5, seed=3, num_samples=2)
    assert len(a) == 2 and a[0] != a[1] and all(len(row) == 30 for row in a)
    [greedy] = generate_tokens(model, [120], 30, NEVER, temperature=0)
    stop = greedy[20]
    [cut] = generate_tokens(model, [120], 30, eos=stop, temperature=0)
    assert cut == greedy[:greedy.index(stop) + 1]
